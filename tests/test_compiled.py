"""`make test-compiled` runs the whole suite against the mypyc-compiled install: same results, checked here
to really be the compiled modules."""

import importlib
import os

import pytest

HOT = ["twin.engine.block_pool", "twin.engine.request", "twin.engine.scheduler", "twin.engine.instance",
       "twin.perf.base", "twin.perf.roofline", "twin.policy.routers", "twin.cluster"]


@pytest.mark.skipif(os.environ.get("LLMTWIN_EXPECT_COMPILED") != "1",
                    reason="pure-Python run; `make test-compiled` checks the compiled build")
@pytest.mark.parametrize("name", HOT)
def test_hot_module_is_compiled(name):
    assert importlib.import_module(name).__file__.endswith(".so")
