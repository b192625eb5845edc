"""`make test-compiled` runs the whole suite against the mypyc-compiled install: same results, checked here
to really be the compiled modules."""

import importlib
import os

import pytest

def hot_modules() -> list[str]:
    """The compiled modules, read from setup.py's HOT_MODULES: the one list (the Makefile reads it too)."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[1] / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "HOT_MODULES":
            return [p.removesuffix(".py").replace("/", ".") for p in ast.literal_eval(node.value)]
    raise AssertionError("setup.py has no HOT_MODULES list")


HOT = hot_modules()


@pytest.mark.skipif(os.environ.get("LLMTWIN_EXPECT_COMPILED") != "1",
                    reason="pure-Python run; `make test-compiled` checks the compiled build")
@pytest.mark.parametrize("name", HOT)
def test_hot_module_is_compiled(name):
    assert importlib.import_module(name).__file__.endswith(".so")


@pytest.mark.skipif(os.environ.get("LLMTWIN_EXPECT_COMPILED") != "1",
                    reason="pure-Python run; `make test-compiled` checks the compiled build")
def test_compiled_build_gives_the_pure_python_results(tmp_path):
    """The same scenario through the compiled install (here) and the source tree (a subprocess)."""
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd

    from twin.sim.cluster import simulate
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    root = Path(__file__).resolve().parents[1]
    scenario = root / "scenarios" / "quickstart.yaml"
    overrides = ["workload.num_requests=400", "cluster.engine.num_gpu_blocks_override=2000",
                 "workload.sessions={turns_mean: 3, think_time_s: 2}", "workload.on_too_long=reject"]
    sc = load_scenario(scenario, overrides)
    compiled = simulate(sc, build_stream(sc)).log.to_frame()
    script = (
        "import sys, twin.engine.scheduler as s; assert s.__file__.endswith('.py'), s.__file__;"
        "from twin.scenario import load_scenario; from twin.workload import build_stream;"
        "from twin.sim.cluster import simulate;"
        f"sc = load_scenario({str(scenario)!r}, {overrides!r});"
        f"simulate(sc, build_stream(sc)).log.to_frame().to_parquet({str(tmp_path / 'pure.parquet')!r})"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path)
    pure = pd.read_parquet(tmp_path / "pure.parquet")
    assert compiled["preemptions"].sum() > 0 and compiled["cached_tokens"].sum() > 0
    pd.testing.assert_frame_equal(compiled, pure, check_exact=False, rtol=1e-12)
