"""`python -m live CONFIG`: the same as the `llmtwin-live` console script."""

from live.cli import main

main()
