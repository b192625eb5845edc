"""Which vLLM engine a scenario models (`engine.vllm_version`): the defaults and the step loop follow the release.

| `vllm_version` | engine | step loop | chunked prefill, prefix caching by default |
| --- | --- | --- | --- |
| < 0.6 | V0, API server in the engine's process | synchronous; a step is prefill-only or decode-only | off, off |
| 0.6 to < 0.8 | V0, API server in its own process | synchronous; a step is prefill-only or decode-only | off, off |
| 0.8 to < 0.14 | V1 | synchronous (`EngineCore.step`); `async_scheduling: true` from 0.10 | on, on |
| >= 0.14 | V1 | async scheduling (`EngineCore.step_with_batch_queue`) | on, on |

Sources:
- V1 became the default engine in 0.8.0.
- Async scheduling came in as `--async-scheduling` (vllm-project/vllm PR #19970, June 2025; 0.10).
- It became the default with PR #27614. That PR is in the #27679 plan, closed around the turn of 2025/26.
  ASSUMPTION: the first release with it on by default is 0.14. Set `async_scheduling` to override.
- V0 before 0.6 ran the OpenAI server and `AsyncLLMEngine` in one process, with detokenization and output
  processing inside the engine step. 0.6.0 moved the API server into its own process and overlapped output
  processing with the next step. vLLM's 0.6.0 release blog measured the GPU busy 38 % of the time for
  Llama-3-8B on one H100 under 0.5.3. The rest was the API server, scheduling and input preparation.
- V0's scheduler (`vllm/core/scheduler.py: Scheduler._schedule_default`) without chunked prefill runs a
  prefill-only step whenever it can admit waiting requests. The running decodes wait for the next step.

What each generation does to step time is in twin.perf.generation (`GenerationModel`). It wraps the step
model, so the scheduler is V1's in every case. V0's differences that the twin does not model: V0's block
manager, swapping on preemption, and its `max_num_batched_tokens` default of max(max_model_len, 2048)
without chunked prefill (twin.engine.defaults raises the token default to max_model_len).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from twin.errors import TwinInputError

DEFAULT_VLLM_VERSION = "0.32"
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+-]?[A-Za-z0-9]+)*$")

V1_SINCE = (0, 8)  # V1 the default engine
ASYNC_FLAG_SINCE = (0, 10)  # --async-scheduling exists (PR #19970)
ASYNC_DEFAULT_SINCE = (0, 14)  # ASSUMPTION: first release with async scheduling on by default (PR #27614)
SPLIT_FRONTEND_SINCE = (0, 6)  # the API server in its own process, output processing overlapped (V0 0.6.0)
PERFORMANCE_MODE_SINCE = (0, 17)  # --performance-mode (merged February 2026, first released in 0.17.0)


def parse_vllm_version(s: object) -> tuple[int, int]:
    """(major, minor) of a vLLM release string such as "0.32", "0.5.4" or "v0.6.3.post1"; one-line error else."""
    if isinstance(s, float):  # YAML reads 0.32 as a number; 0.10 as 0.1, which only a quoted string tells apart
        if len(repr(s).partition(".")[2]) < 2:
            raise TwinInputError(f"vllm_version {s!r} is a number that may have lost a 0 (YAML reads 0.10 as 0.1): "
                                 "quote it, e.g. \"0.10\" or \"0.5.4\"")
        s = repr(s)
    m = _VERSION.match(s.strip()) if isinstance(s, str) else None
    if m is None:
        raise TwinInputError(f"vllm_version {s!r} is not a vLLM release (write it as e.g. \"0.32\" or \"0.5.4\")")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class EngineGeneration:
    """What a vLLM release does that changes timing, and the defaults it resolves."""

    version: tuple[int, int]

    @property
    def is_v1(self) -> bool:
        return self.version >= V1_SINCE

    @property
    def name(self) -> str:
        return "v1" if self.is_v1 else "v0"

    @property
    def async_scheduling_default(self) -> bool:
        return self.version >= ASYNC_DEFAULT_SINCE

    @property
    def async_scheduling_available(self) -> bool:
        return self.version >= ASYNC_FLAG_SINCE

    @property
    def prefill_only_steps(self) -> bool:
        """V0 without chunked prefill: a step computes prefills or decodes, never both."""
        return not self.is_v1

    @property
    def api_server_in_engine_process(self) -> bool:
        """Before 0.6 the API server and output processing ran inside the engine loop, in series with the GPU."""
        return self.version < SPLIT_FRONTEND_SINCE

    def defaults(self) -> dict[str, bool]:
        """Engine arguments whose default follows the release (the scenario's own values win)."""
        return {"async_scheduling": self.async_scheduling_default, "enable_chunked_prefill": self.is_v1,
                "enable_prefix_caching": self.is_v1}


def generation(vllm_version: object = DEFAULT_VLLM_VERSION) -> EngineGeneration:
    return EngineGeneration(parse_vllm_version(vllm_version))


def resolve_engine_args(raw: dict) -> dict:
    """The engine section with the release's defaults filled in where the scenario leaves them unset.

    Raises ValueError (a scenario field error) for a bad version, or for async scheduling before 0.10 /
    on V0."""
    v = raw.get("vllm_version", DEFAULT_VLLM_VERSION)
    try:
        gen = generation(v)
    except TwinInputError as e:
        raise ValueError(f"@vllm_version: {e}") from None
    out = dict(raw)
    if isinstance(v, float):
        out["vllm_version"] = repr(v)  # an unambiguous number, e.g. 0.32: kept as the string it names
    for k, d in gen.defaults().items():
        if out.get(k) is None:
            out[k] = d
    if out.get("performance_mode", "balanced") != "balanced" and gen.version < PERFORMANCE_MODE_SINCE:
        raise ValueError(f"@performance_mode: vllm_version {v} has no --performance-mode (it came in vLLM 0.17)")
    if out["async_scheduling"] is True and not gen.async_scheduling_available:
        why = "the V0 engine has no async scheduling" if not gen.is_v1 else "--async-scheduling came in vLLM 0.10"
        raise ValueError(f"@async_scheduling: vllm_version {v} cannot run with async_scheduling: true ({why})")
    return out


# engine-section fields the step model reads (twin.perf.generation), not the engine config
GENERATION_KNOBS = ("async_exposed_step_s", "async_exposed_request_s", "v0_seq_host_s")
