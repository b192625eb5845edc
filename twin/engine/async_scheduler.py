"""Async scheduling: vLLM's `AsyncScheduler` (`vllm/v1/core/sched/async_scheduler.py`), a subclass of the
synchronous scheduler, as there.

vLLM's `AsyncScheduler` is driven by `EngineCore.step_with_batch_queue`
with a batch queue of depth 2, `vllm/v1/core/sched/async_scheduler.py`, `vllm/v1/engine/core.py`): the
engine loop calls `schedule(k+1)` while step k runs on the GPU, then `update_from_output(k)`. The twin keeps
its own call order (update(k), then schedule(k+1)) and reproduces what that reordering changes:

- *The decision is made one step earlier*: schedule(k+1) sees only requests that reached the engine by the
  start of step k (`inbox` holds later ones until `admit_inbox`), and its SCHEDULED time is that start.
- *Outputs are processed one step later*: a request that finished in step k still holds its blocks and its
  seat in `running` during schedule(k+1), getting no token (vLLM's max_tokens check on
  `num_output_placeholders` in `Scheduler.schedule`), and is freed after it (`finishing`, `release_finished`):
  its blocks serve schedule(k+2). It can still be taken as a preemption victim in schedule(k+1), as in vLLM.
- *Output blocks are cached one step later*: `allocate_slots` caches only tokens already known, and the token
  sampled in step k is known only after schedule(k+1), so a decode caches the block its last token filled
  one step after the synchronous engine would (`_reg_lag`). A member preempted with a token in flight has
  that block uncached (`update_from_output` skips caching for preempted requests).
- *Decode tokens are optimistic*: a request whose final prefill chunk ran in step k is scheduled a decode in
  k+1 from a placeholder; its blocks and budget are those of the synchronous decode, so nothing changes there.
- *Timing*: schedule(k+1) and its input preparation run on the CPU while the GPU runs step k, so the CPU part
  of a step (`host_time_s` of the step model) is hidden up to the previous step's GPU time: a step lasts
  step_time - min(cpu, previous step's GPU time). After an idle engine (or an empty schedule) nothing was
  running to hide behind, so the first step pays its CPU in full.

Not modelled: a decode member skipped for budget under async caches its blocks on the synchronous lag
afterwards (vLLM: no placeholder for the skipped step); such skips need a long-prefill threshold.
"""

from __future__ import annotations

from twin.engine.block_pool import BlockPool
from twin.engine.request import Request
from twin.engine.output import SchedulerOutput
from twin.engine.scheduler import Scheduler, SchedulerConfig
from twin.engine.sink import EngineSink
from twin.perf.base import StepTimeModel


class AsyncScheduler(Scheduler):
    """The scheduler under async scheduling: decisions one step early, outputs and frees one step late,
    and each step's CPU work hidden behind the previous step's GPU time."""

    def _is_async(self) -> bool:
        return True

    def _enqueue(self, r: Request, now: float) -> None:
        """It waits in `inbox` until a decision made after `now` (vLLM drains its input queue only before
        `schedule()`)."""
        self.inbox.append((r, now))

    # -- the batch queue's boundary (EngineCore.step_with_batch_queue) ----------------------------------
    def begin_step(self, now: float) -> None:
        if not self.running and not self.waiting:
            self.wake(now)
        self.admit_inbox()

    def after_schedule(self, out: SchedulerOutput) -> bool:
        """update_from_output(k) runs after schedule(k+1): the previous step's finishers are freed now. An empty
        decision is made again now, after the frees, with nothing to overlap."""
        released = self.release_finished()
        if out.is_empty:
            self.prev_gpu_s = 0.0
            return released or bool(self.inbox)
        return False

    def wake(self, now: float) -> None:
        """An idle engine starts again: the next decision is made now, with no GPU work to hide behind."""
        self.next_decision_t = now
        self.prev_gpu_s = 0.0

    def admit_inbox(self) -> bool:
        """Requests that reached the engine by the next decision's time join the waiting queue (in order)."""
        inbox = self.inbox
        if not inbox:
            return False
        t = self.next_decision_t
        i = 0
        while i < len(inbox) and inbox[i][1] <= t:
            self._queue(inbox[i][0])
            i += 1
        if i:
            del inbox[:i]
        return i > 0

    def release_finished(self) -> bool:
        """After schedule(k+1), update_from_output(k) frees the requests that finished in step k."""
        if not self.finishing:
            return False
        for r in self.finishing:
            self.kv.free(r, preempted=False)
            self.running.remove(r)
        self.finishing = []
        return True

    def _decision_time(self, now: float) -> float:
        """Decided at the start of the step before (`next_decision_t`); the next decision is made now."""
        t = self.next_decision_t
        self.next_decision_t = now
        return t

    def _tokens_in_flight(self, r: Request) -> int:
        return 1 if r.d_base < self.group.group_step else 0  # it decoded in the step in flight

    def _retire(self, r: Request) -> None:
        self.finishing.append(r)  # freed after the next schedule (release_finished)

    # -- timing ------------------------------------------------------------------------------------------
    def step_duration(self, out: SchedulerOutput) -> float:
        """The step model's time less the CPU hidden behind the step before it (`host_time_s`)."""
        b = out.batch()
        x = self.perf.step_time(b)
        c = self._host_s(b.num_requests) if self._host_s is not None else 0.0
        hidden = c if c < self.prev_gpu_s else self.prev_gpu_s
        self.prev_gpu_s = x - c
        return x - hidden

    def decode_run_plan(self, k: int, t0: float) -> list[float]:
        """As the synchronous plan, each step's CPU hidden behind the step before; the last step's finishers
        are freed now, right after the run's first decision (`after_schedule`; `_run_frees_finishers`), which
        takes the first step's blocks and caches its output blocks before them, as `schedule` would."""
        if self.finishing:
            self._take_first_step()
            self.release_finished()
        g = self.group
        nd = g.num_decode
        c = self._host_s(nd) if self._host_s is not None else 0.0
        g_prev = self.prev_gpu_s
        t = t0
        self.run_c = c
        if self._closed_form and nd > 0:  # `FittedModel.decode_run_times`, inlined: the same floats
            # typed (`Scheduler.decode_params`), so the compiled loop below runs on C doubles
            params = self.decode_params(nd)
            self.run_params = params
            attn_s, kv_s, cd, rest = params
            # the context as a float: exact (an integer below 2**53), so the same products, without an int add and
            # an int-to-float conversion per step when compiled
            ctx = float(g.decode_context)
            ndf = float(nd)
            ends: list[float] = [0.0] * k  # filled in place: no append, no regrowth of the list
            s = 0
            # With non-negative terms a step's time never shrinks as the context grows (rounding is monotone),
            # so once a step *of this run* has GPU time covering the CPU (c <= g_prev) every later step hides
            # exactly c (the step before the run, a prefill say, may have covered it while this run's first does
            # not); and with 0 <= attn_s <= kv_s (every shipped profile) the KV side is the max at every context.
            # The second loop drops what is then known: the same operations on the same floats, fewer of them.
            settles = cd >= 0.0 and 0.0 <= attn_s <= kv_s
            while s < k and not (settles and s > 0 and c <= g_prev):
                a = attn_s * ctx
                b = kv_s * (ctx + ndf)
                x = (0.0 + cd * (a if a > b else b)) + rest
                t += x - (c if c < g_prev else g_prev)
                ends[s] = t
                g_prev = x - c
                ctx += ndf
                s += 1
            for i in range(s, k):
                t += ((0.0 + cd * (kv_s * (ctx + ndf))) + rest) - c
                ends[i] = t
                ctx += ndf
            return ends  # run_x stays empty: only a plan without the closed form fills it
        xs = self.perf.decode_run_times(nd, g.decode_context, k)
        ends = []
        for x in xs:
            t += x - (c if c < g_prev else g_prev)
            ends.append(t)
            g_prev = x - c
        self.run_x = xs
        return ends

    def _take_first_step(self) -> None:
        """The run's first decision, before the frees: its new blocks (from the front of the free queue, evicting
        as `schedule` would) and its members' filled output blocks, cached in running order
        (`_schedule_running_fast`). `commit_decode_run` takes the rest."""
        g = self.group
        need = g.phase_count[(-g.group_step) % self.block_size]
        self.pool.allocate(need)
        self.run_first_taken = need
        if g.num_reg_members:
            d = g.group_step - self._reg_lag
            for r in g.crossing(d):
                self._register_member(r, d)

    def _after_run(self, j: int, ends: list[float], t0: float) -> None:
        """The next decision was made as step j started; step j's GPU time is what the next CPU hides behind."""
        self.next_decision_t = ends[j - 2] if j >= 2 else t0
        if self.run_x:
            x = self.run_x[j - 1]
            self.run_x = []
        else:  # the closed form of the plan, at step j-1's context (the group has not moved yet)
            attn_s, kv_s, cd, rest = self.run_params
            nd = self.group.num_decode
            ctx = self.group.decode_context + (j - 1) * nd
            a = attn_s * ctx
            b = kv_s * (ctx + nd)
            x = (0.0 + cd * (a if a > b else b)) + rest
        self.prev_gpu_s = x - self.run_c


def make_scheduler(config: SchedulerConfig, pool: BlockPool, perf: StepTimeModel, sink: EngineSink) -> Scheduler:
    """The scheduler class the config asks for (vLLM: `scheduler_cls` from `async_scheduling`)."""
    cls = AsyncScheduler if config.async_scheduling else Scheduler
    return cls(config, pool, perf, sink)
