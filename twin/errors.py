"""One exception type for bad user input, so the CLI can print one clear line instead of a traceback."""

from __future__ import annotations


class TwinInputError(ValueError):
    """A user-facing input problem: a bad scenario field, trace row, model or GPU name."""
