"""One instance's API server as a queue: the time a request and its tokens spend in vLLM's front end.

vLLM's OpenAI server (vllm/entrypoints/openai/api_server.py, run by uvicorn) is ONE asyncio event loop per
engine: it parses each HTTP request, renders and tokenizes its prompt and hands it to the engine
(`AsyncLLM.add_request` -> `InputProcessor.process_inputs`, vllm/v1/engine/async_llm.py), and the same loop's
`AsyncLLM._run_output_handler` task pulls every step's `EngineCoreOutputs` from EngineCore, detokenizes them
(`OutputProcessor.process_outputs`, chunks of VLLM_V1_OUTPUT_PROC_CHUNK_SIZE with `await asyncio.sleep(0)`
between them) and wakes each request's stream, which writes one SSE chunk per token. So the two kinds of work
share one server:

- per request (`api_request_s`: overhead + per prompt token): requests queue FIFO for it; a burst of
  simultaneous requests gets increasing waits, and the engine sees them one after another.
- per output token (`api_token_s`): the engine's token stream takes `rate x api_token_s` of the loop's time,
  rho. A request's pre-processing, interleaved with that output work at the loop's await points, is
  stretched to `service / (1 - rho)`, with rho capped at `api_rho_cap` (ASSUMPTION, `perf.api_rho_cap`,
  default 0.9: the loop still interleaves when the output work would saturate it).
- tokens the engine emits while requests are still queued for pre-processing reach the client only once
  that backlog is done (`delivery_wait`): the first token of a burst's first request waits for the rest of
  the burst's parsing. Each token is then streamed `api_token_s` after that, as before.

The account is per event, never per token: one `preprocess` per request, one `delivery_wait` at a request's
first token and at its finish; the token rate is read off the engine's step in progress
(`Instance.token_rate`).

For the fit (twin.lab.calibrate) the server can carry the gradient of its times with respect to the three API
terms (`api_request_overhead_s`, `api_prompt_token_s`, `api_output_token_s`) on the run's schedule, and
record them per request (`record`).
"""

from __future__ import annotations

from heapq import heappop, heappush
import math
from dataclasses import dataclass, field

Grad = tuple[float, float, float]
ZERO: Grad = (0.0, 0.0, 0.0)


def _add(a: Grad, b: Grad, k: float = 1.0) -> Grad:
    return (a[0] + k * b[0], a[1] + k * b[1], a[2] + k * b[2])


@dataclass
class ApiServer:
    """One instance's API server: requests in pre-processing (processor sharing or FIFO), and the backlog
    its streamed tokens wait for."""

    rho_cap: float = 0.9  # ASSUMPTION: the largest share of the loop the token stream can take
    discipline: str = "ps"  # "ps": the loop interleaves every request in pre-processing; "fifo": one at a time
    free_at: float = -math.inf  # FIFO: when the last queued request's pre-processing ends
    grad: Grad = ZERO  # d free_at / d (api_request_overhead_s, api_prompt_token_s, api_output_token_s)
    num_requests: int = 0
    busy_s: float = 0.0  # pre-processing time served, stretched
    generation: int = 0  # the cluster's wake-up timer in force (older ones are stale)
    # processor sharing, by virtual time: every request in pre-processing has received `v` seconds of
    # service (gradient `gv`) as of `t_last` (gradient `gt`); a request is done when v reaches its tag
    t_last: float = 0.0
    gt: Grad = ZERO
    v: float = 0.0
    gv: Grad = ZERO
    # heap of (tag, seq, tag gradient, request index); typed: compiled, an entry unpacks to native parts
    jobs: list[tuple[float, int, Grad, int]] = field(default_factory=list, repr=False)
    sum_tags: float = 0.0
    sum_gtags: Grad = ZERO
    # request index -> (engine entry time, its gradient), and (wait, gradient of the delivery time) at the
    # first token and at the finish; None unless the fit asks (twin.lab.calibrate)
    record: dict[int, list] | None = field(default=None, repr=False)

    def work(self, raw: float, prompt_tokens: int, output_token_s: float, token_rate: float) -> tuple[float, Grad]:
        """A request's pre-processing, `raw` seconds (`api_request_s`) stretched by the token stream's share
        rho of the loop, and its gradient in the three API terms."""
        rho = token_rate * output_token_s
        capped = rho >= self.rho_cap
        if capped:
            rho = self.rho_cap
        stretch = 1.0 / (1.0 - rho)
        # d stretch / d output_token_s = rate / (1 - rho)^2 while rho is below the cap
        d_out = 0.0 if capped else raw * token_rate * stretch * stretch
        return raw * stretch, (stretch, stretch * prompt_tokens, d_out)

    # -- FIFO ----------------------------------------------------------------------------------------------
    def preprocess(self, now: float, raw: float, prompt_tokens: int, output_token_s: float, token_rate: float,
                   idx: int = -1) -> float:
        """FIFO: a request arrives now; when its pre-processing ends (it enters the engine)."""
        service, gw = self.work(raw, prompt_tokens, output_token_s, token_rate)
        if self.free_at > now:
            start, g = self.free_at, self.grad
        else:
            start, g = now, ZERO
        end = start + service
        if self.record is not None:  # gradients only for the fit
            self.grad = _add(g, gw)
        self.free_at = end
        self.num_requests += 1
        self.busy_s += service
        if self.record is not None and idx >= 0:
            self.record[idx] = [(end, self.grad), None, None]
        return end

    # -- processor sharing --------------------------------------------------------------------------------
    def _advance(self, t: float) -> None:
        """Virtual time to an arrival at t (a fixed time: its gradient is 0)."""
        n = len(self.jobs)
        if n:
            self.v += (t - self.t_last) / n
            if self.record is not None:
                self.gv = _add(self.gv, self.gt, -1.0 / n)
        self.t_last, self.gt = t, ZERO

    def arrive(self, now: float, raw: float, prompt_tokens: int, output_token_s: float, token_rate: float,
               idx: int) -> None:
        """PS: a request arrives now and shares the loop with every request in pre-processing."""
        service, gw = self.work(raw, prompt_tokens, output_token_s, token_rate)
        self._advance(now)
        if not self.jobs:
            self.v, self.gv, self.sum_tags, self.sum_gtags = 0.0, ZERO, 0.0, ZERO
        tag = self.v + service
        gtag = ZERO
        if self.record is not None:
            gtag = _add(self.gv, gw)
            self.sum_gtags = _add(self.sum_gtags, gtag)
        heappush(self.jobs, (tag, self.num_requests, gtag, idx))
        self.sum_tags += tag
        self.num_requests += 1
        self.busy_s += service

    def next_done(self) -> float:
        """PS: when the next request's pre-processing ends if none arrives before (inf: none in it)."""
        if not self.jobs:
            return math.inf
        return self.t_last + (self.jobs[0][0] - self.v) * len(self.jobs)

    def pop_done(self, now: float) -> list[int]:
        """PS: the requests whose pre-processing has ended by now, in order (they enter the engine)."""
        done = []
        while self.jobs:
            tag, _, gtag, idx = self.jobs[0]
            n = len(self.jobs)
            t_done = self.t_last + (tag - self.v) * n
            if t_done > now + 1e-12 * max(1.0, abs(now)):
                break
            heappop(self.jobs)
            if self.record is not None:
                self.gt = _add(self.gt, _add(gtag, self.gv, -1.0), float(n))
                self.sum_gtags = _add(self.sum_gtags, gtag, -1.0)
                if idx >= 0:
                    self.record[idx] = [(t_done, self.gt), None, None]
            self.t_last, self.v, self.gv = t_done, tag, gtag
            self.sum_tags -= tag
            done.append(idx)
        return done

    def backlog_end(self) -> tuple[float, Grad]:
        """When the pre-processing in the server now would all be done (and its gradient)."""
        if self.discipline != "ps":
            return self.free_at, self.grad
        n = len(self.jobs)
        if not n:
            return -math.inf, ZERO
        end = self.t_last + (self.sum_tags - n * self.v)
        if self.record is None:
            return end, ZERO
        return end, _add(_add(self.gt, self.sum_gtags), self.gv, -float(n))

    # -- both ------------------------------------------------------------------------------------------------
    def entry_if_sent(self, now: float, raw: float, output_token_s: float, token_rate: float) -> float:
        """When a request sent now would enter the engine, leaving the server as it is (forecasts): after the
        work in it now, then its own (exact for FIFO; for PS an upper bound)."""
        rho = min(token_rate * output_token_s, self.rho_cap)
        end, _ = self.backlog_end()
        return max(now, end) + raw / (1.0 - rho)

    def delivery_wait(self, t: float, idx: int = -1, which: int = 1) -> float:
        """How long a token the engine emits at t waits for the pre-processing in the server ahead of it."""
        end, g = self.backlog_end()
        wait = end - t
        if wait <= 0.0:
            wait = 0.0
        if self.record is not None and idx >= 0 and idx in self.record:
            self.record[idx][which] = (wait, g)
        return wait
