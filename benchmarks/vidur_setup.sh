#!/usr/bin/env bash
# Make benchmarks/.vidur-venv with Vidur from PyPI, apart from the project's own .venv.
# vidur 0.0.26 needs no torch (its dependencies: numpy, pandas, scikit-learn, wandb, kaleido, ddsketch,
# plotly_express, matplotlib, seaborn, fasteners, click, huggingface_hub, ninja, paretoset, randomname,
# streamlit); it ships a cp311 manylinux wheel with a native extension. About 1.3 GB installed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.vidur-venv"
py="${PYTHON:-python3.11}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
"$venv/bin/pip" install -q "vidur==0.0.26"
"$venv/bin/python" -c "import vidur.main, vidur.simulator; print('vidur', __import__('importlib.metadata').metadata.version('vidur'), 'ready in', '$venv')"
