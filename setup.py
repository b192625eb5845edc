"""Metadata lives in pyproject.toml. This file only adds the optional compiled build.

`LLMTWIN_COMPILE=1 pip install --no-build-isolation .` (with mypy installed) compiles the simulator's hot
modules with mypyc: same code, same results, about 6-7x faster on bench-16xh100 (README, Speed). Without the
variable the install is pure Python. `make compiled` does this in .venv-fast.
"""

import os

from setuptools import setup

HOT_MODULES = [
    "twin/engine/block_pool.py",
    "twin/engine/request.py",
    "twin/engine/segment_pool.py",
    "twin/engine/scheduler.py",
    "twin/engine/async_scheduler.py",
    "twin/engine/output.py",
    "twin/engine/stats.py",
    "twin/engine/kv_cache_manager.py",
    "twin/engine/decode_group.py",
    "twin/engine/core.py",
    "twin/engine/config.py",
    "twin/sim/instance.py",
    "twin/perf/base.py",
    "twin/perf/roofline.py",
    "twin/perf/fitted.py",
    "twin/sim/cluster.py",
    "twin/sim/dispatcher.py",
    "twin/sim/api_server.py",
    "twin/sim/timeline.py",
    "twin/policy/bookkeeping.py",
    "twin/policy/signals.py",
    "twin/policy/views.py",
    "twin/policy/host.py",
    "twin/sim/events.py",
]

ext_modules = []
if os.environ.get("LLMTWIN_COMPILE") == "1":
    from mypyc.build import mypycify

    # errors in modules that are imported but not compiled (trace readers...) must not stop the build
    ext_modules = mypycify(["--ignore-missing-imports", "--follow-imports=silent", *HOT_MODULES], opt_level="3")

setup(ext_modules=ext_modules)
