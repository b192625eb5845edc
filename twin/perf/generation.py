"""Step time by engine generation (twin.specs.vllm_versions): a `StepTimeModel` wrapped around the scenario's.

`build_perf` wraps the step model when the release or the overlap settings change anything.

**V1 with async scheduling.** What vLLM 0.32 overlaps, from its code:
- The loop (`vllm/v1/engine/core.py: EngineCore.step_with_batch_queue`, a batch queue of depth 2) schedules
  step k+1, then calls `execute_model(k+1, non_block=True)` and `sample_tokens(non_block=True)`. For TP 1
  the executor (`vllm/v1/executor/uniproc_executor.py: UniProcExecutor.collective_rpc`) runs these on the
  engine-core thread: `_update_states`, `_prepare_inputs` and the kernel launches. They return once the
  kernels are queued behind step k.
- Only then does the loop block on step k's output (`AsyncGPUModelRunnerOutput.get_output`, the wait on the
  D2H copy event), run `update_from_output(k)` and send the outputs.
- So all the engine core's host work of one iteration (update(k-1), schedule(k+1), input preparation,
  launch) runs while the GPU computes step k. The step period is max(GPU time, host time).
- The only waits that stay in series: `synchronize_input_prep` (`gpu_model_runner.py`) waits for the previous
  step's H2D input copy, queued at that step's start, so it has long finished. The sampled tokens reach the
  next step's inputs on the GPU (`prev_sampled_token_ids`), never through the host.
- The engine (twin.engine.scheduler `step_duration`) hides `host_time_s` up to the previous step's GPU time.
  After an idle engine, or an empty schedule, there is nothing to hide behind, and the host time is paid in full.
- ASSUMPTION: `async_exposed_step_s` and `async_exposed_request_s`, both 0 by default, are host time per step
  and per scheduled request that is never hidden. Examples: kernel-launch gaps on piecewise-graph (mixed)
  steps; GIL time taken by the input and output threads (request deserialization, block hashing, msgspec
  encoding), which shares the interpreter with the loop. This part of `host_time_s` stays on the critical path.

**V0** (< 0.8; `vllm/core/scheduler.py: Scheduler._schedule_default` without chunked prefill). A step that
admits prompts computes only them. The running decodes get their next token one step later. So a step the V1
scheduler mixes costs here a prefill pass plus a decode pass, each with its own fixed costs (weights read
again, CPU overhead again). ASSUMPTION: the twin keeps V1's step boundaries, so in such a step the admitted
requests' first token comes at the end of both passes, one decode pass later than in V0.

**V0 before 0.6.** The API server, detokenization and output processing ran in the engine's process and loop,
in series with the GPU step. This costs `v0_seq_host_s` per scheduled sequence per step. ASSUMPTION (140 us):
from vLLM's 0.6.0 release blog, which measured the GPU busy 38 % of the time for Llama-3-8B on one H100 under
0.5.3. On the twin's H100 roofline, a decode step of 64 sequences at ~500 tokens of context takes ~7 ms of GPU
time. Host time is 62/38 of that, ~11.4 ms; less the 2.3 ms step overhead, that is ~140 us a sequence.
"""

from __future__ import annotations

from twin.specs.vllm_versions import EngineGeneration
from twin.perf.base import StepBatch, StepTimeModel


class GenerationModel:
    """The scenario's step model as the release's engine loop runs it (see the module docstring)."""

    def __init__(self, base: StepTimeModel, gen: EngineGeneration, async_exposed_step_s: float = 0.0,
                 async_exposed_request_s: float = 0.0, v0_seq_host_s: float = 0.0) -> None:
        self.base = base
        self.gen = gen
        self.gpu = base.gpu
        self.async_exposed_step_s = async_exposed_step_s
        self.async_exposed_request_s = async_exposed_request_s
        self.split = gen.prefill_only_steps
        self.seq_host_s = v0_seq_host_s if gen.api_server_in_engine_process else 0.0
        self._base_host = getattr(base, "host_time_s", None)

    def __getattr__(self, name: str):
        # sizes, API-server times and anything else the base model answers (only reached for names not set here)
        return getattr(self.__dict__["base"], name)

    # -- step time ------------------------------------------------------------------------------------
    def step_time(self, b: StepBatch) -> float:
        if self.split and b.num_prefill_tokens > 0 and b.num_decode_tokens > 0:
            pre = StepBatch(num_prefill_tokens=b.num_prefill_tokens, prefill_attn_tokens=b.prefill_attn_tokens,
                            prefill_kv_read_tokens=b.prefill_kv_read_tokens, num_prefill_sampled=b.num_prefill_sampled,
                            num_prefill_reqs=b.num_prefill_reqs)
            dec = StepBatch(num_decode_tokens=b.num_decode_tokens, decode_context_tokens=b.decode_context_tokens)
            return self.base.step_time(pre) + self.base.step_time(dec) + self.seq_host_s * b.num_requests
        x = self.base.step_time(b)
        if self.seq_host_s and x > 0.0:
            x += self.seq_host_s * b.num_requests
        return x

    def decode_run_times(self, num_decode: int, context0: int, k: int) -> list[float]:
        xs = self.base.decode_run_times(num_decode, context0, k)
        if not self.seq_host_s or num_decode <= 0:
            return xs
        extra = self.seq_host_s * num_decode
        return [x + extra for x in xs]

    def host_time_s(self, num_requests: int) -> float:
        """The host time async scheduling may hide: the base model's, less the part that stays in series."""
        if self._base_host is None:
            return 0.0
        c = self._base_host(num_requests)
        keep = self.async_exposed_step_s + self.async_exposed_request_s * num_requests
        return c - keep if c > keep else 0.0

    def group_times(self, b: StepBatch) -> dict[str, float]:
        """The base model's groups (both passes summed for a V0 split step), and the V0 host time as `v0_host`."""
        g = getattr(self.base, "group_times")
        if self.split and b.num_prefill_tokens > 0 and b.num_decode_tokens > 0:
            a = g(StepBatch(num_prefill_tokens=b.num_prefill_tokens, prefill_attn_tokens=b.prefill_attn_tokens,
                            prefill_kv_read_tokens=b.prefill_kv_read_tokens,
                            num_prefill_sampled=b.num_prefill_sampled, num_prefill_reqs=b.num_prefill_reqs))
            d = g(StepBatch(num_decode_tokens=b.num_decode_tokens, decode_context_tokens=b.decode_context_tokens))
            out = {k: a.get(k, 0.0) + d.get(k, 0.0) for k in {*a, *d}}
        else:
            out = dict(g(b))
        out["v0_host"] = self.seq_host_s * b.num_requests if b.num_tokens else 0.0
        return out

    def ideal(self) -> "GenerationModel":
        """The physical floor of the same engine generation: V0's two passes stay, host time goes."""
        return GenerationModel(self.base.ideal(), self.gen)

    def describe(self) -> dict:
        d = dict(self.base.describe())
        d["engine_generation"] = {
            "vllm_version": ".".join(map(str, self.gen.version)), "engine": self.gen.name,
            "prefill_only_steps": self.split, "v0_seq_host_s": self.seq_host_s,
            "async_exposed_step_s": self.async_exposed_step_s,
            "async_exposed_request_s": self.async_exposed_request_s,
            "assumptions": ["async_exposed_step_s", "async_exposed_request_s"]
                           + (["v0_seq_host_s"] if self.seq_host_s else [])
                           + (["v0_first_token_after_both_passes"] if self.split else []),
        }
        return d


def wrap_for_generation(perf: StepTimeModel, engine_spec) -> StepTimeModel:
    """`perf` as the scenario's engine generation runs it; unchanged for V1 with nothing kept in series."""
    from twin.specs.vllm_versions import generation

    gen = generation(engine_spec.vllm_version)
    e = engine_spec
    if gen.is_v1 and not e.async_exposed_step_s and not e.async_exposed_request_s:
        return perf
    return GenerationModel(perf, gen, e.async_exposed_step_s, e.async_exposed_request_s, e.v0_seq_host_s)
