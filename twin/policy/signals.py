"""Recent traffic as the router side sees it: arrivals and completed requests over a sliding window.

Both worlds feed it (the simulator's dispatcher, the live proxy) and scalers read it: P99 latency over the
last minutes, the arrival rate, mean prompt and output lengths, binned arrival counts for forecasters.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class Completion:
    """A finished request as the window keeps it (treat as read-only)."""

    t: float
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    output_tokens: int

    def __init__(self, t: float, ttft_s: float, e2e_s: float, prompt_tokens: int, output_tokens: int) -> None:
        # written out (dataclass keeps it): one per finish, a native constructor when compiled
        self.t = t
        self.ttft_s = ttft_s
        self.e2e_s = e2e_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


class RecentWindow:
    """Arrivals `(t, prompt_tokens)` and completions kept for `horizon_s` seconds (older ones are dropped)."""

    def __init__(self, horizon_s: float = 3600.0, observed_since: float | None = None) -> None:
        self.horizon_s = horizon_s
        # when the world began watching (the simulation's start, the controller's): bins from then on were
        # observed, arrivals or not; None: from the first arrival
        self.observed_since = observed_since
        self.arrivals: deque[tuple[float, int]] = deque()
        self.completions: deque[Completion] = deque()
        self.total_arrivals = 0
        self.total_completions = 0
        self.first_arrival_s: float | None = None  # kept when trimmed: bins before it were never observed
        # running prompt and output totals after each completion, beside `completions` (`mean_lengths` reads a
        # window as the difference of two of them), the totals of those trimmed, and per window length the
        # first completion inside it at the last look (its number since the start, and that look's time)
        self._cum: deque[tuple[int, int]] = deque()
        self._sum_p = 0
        self._sum_o = 0
        self._trimmed = (0, 0)
        self._first_in: dict[float, tuple[int, float]] = {}
        self._in_order = True  # completions came in time order (`recent` is then a suffix from a cursor)

    def copy(self) -> "RecentWindow":
        """A copy its owner's appends do not reach (a policy deciding on another thread reads it)."""
        w = RecentWindow(self.horizon_s, self.observed_since)
        w.arrivals.extend(self.arrivals)
        w.completions.extend(self.completions)
        w.total_arrivals, w.total_completions = self.total_arrivals, self.total_completions
        w.first_arrival_s = self.first_arrival_s
        w._cum.extend(self._cum)
        w._sum_p, w._sum_o, w._trimmed = self._sum_p, self._sum_o, self._trimmed
        w._first_in = dict(self._first_in)
        w._in_order = self._in_order
        return w

    def _trim(self, now: float) -> None:
        cut = now - self.horizon_s
        a, c = self.arrivals, self.completions
        while a and a[0][0] < cut:
            a.popleft()
        cum = self._cum
        aligned = len(cum) == len(c)
        while c and c[0].t < cut:
            c.popleft()
            if aligned:
                self._trimmed = cum.popleft()

    def arrived(self, t: float, prompt_tokens: int) -> None:
        if self.first_arrival_s is None:
            self.first_arrival_s = t
        self.arrivals.append((t, prompt_tokens))
        self.total_arrivals += 1
        if len(self.arrivals) & 1023 == 0:
            self._trim(t)

    def finished(self, t: float, ttft_s: float, e2e_s: float, prompt_tokens: int, output_tokens: int) -> None:
        c = self.completions
        if c and t < c[-1].t:
            self._in_order = False
        c.append(Completion(t, ttft_s, e2e_s, prompt_tokens, output_tokens))
        self._sum_p += prompt_tokens
        self._sum_o += output_tokens
        self._cum.append((self._sum_p, self._sum_o))
        self.total_completions += 1
        if len(self.completions) & 1023 == 0:
            self._trim(t)

    def recent(self, now: float, window_s: float) -> list[Completion]:
        cut = now - window_s
        out = []
        for c in reversed(self.completions):
            if c.t < cut:
                break
            out.append(c)
        out.reverse()
        return out

    def quantile(self, now: float, metric: str, q: float, window_s: float) -> float | None:
        """`metric` in ttft_s, e2e_s, tpot_s over completions in the window; None when there are none."""
        vals = sorted(getattr(c, metric) for c in self.recent(now, window_s))
        if not vals:
            return None
        return vals[min(len(vals) - 1, max(0, math.ceil(q * len(vals)) - 1))]

    def observed_from(self) -> float | None:
        """When observing began: `observed_since` (the world's start) or, when earlier or not given, the first
        arrival; None before anything was observed (no start given, no arrival yet)."""
        first = self.first_arrival_s
        if self.observed_since is not None:
            first = self.observed_since if first is None else min(first, self.observed_since)
        return first

    def observed_span(self, now: float, window_s: float) -> float:
        """The part of the last `window_s` observed (`observed_from` on); 0.0 when nothing has been observed."""
        first = self.observed_from()
        if first is None or window_s <= 0:
            return 0.0
        return max(0.0, now - max(now - window_s, first))

    def rate(self, now: float, window_s: float) -> float:
        """Arrivals per second over the last `window_s`, or over the part of it observed (as `arrival_series`).

        Before the window has filled, dividing by the whole window made the first readings too low (10 req/s
        seen for 10 s of a 60 s window read as 1.7 req/s). 0.0 when nothing has been observed yet."""
        span = self.observed_span(now, window_s)
        if span <= 0:
            return 0.0
        cut = now - window_s
        n = 0
        for t, _ in reversed(self.arrivals):
            if t < cut:
                break
            if t <= now:
                n += 1
        return n / span

    def completion_rate(self, now: float, window_s: float) -> float:
        """Completions per second over the last `window_s`, or over the part of it observed, as `rate` reads
        arrivals (the fleet forecast's drain rate, `twin.sim.forecaster._backlog_free_at`)."""
        span = self.observed_span(now, window_s)
        return len(self.recent(now, window_s)) / span if span > 0 else 0.0

    def mean_lengths(self, now: float, window_s: float) -> tuple[float | None, float | None]:
        """Mean prompt and output tokens of the requests completed in the window (those `recent` gives).

        Read as the difference of two running totals, from where the window began at the last look, moved
        forward (time only moves on): a forecaster asks once a decision, and a scan of a 600 s window of
        completions grew with the run. Completions added by hand (not through `finished`) or out of time
        order, or a look back in time, are scanned as before; the sums are the same integers either way."""
        c = self.completions
        cum = self._cum
        if not self._in_order or len(cum) != len(c):
            return self._scan_means(now, window_s)
        cut = now - window_s
        base = self.total_completions - len(c)  # completions trimmed
        seen = self._first_in.get(window_s)
        if seen is None or now < seen[1] or seen[0] < base:
            rec_n = len(self.recent(now, window_s))
            g = self.total_completions - rec_n
        else:
            g = seen[0]
            while g < self.total_completions and c[g - base].t < cut:
                g += 1
        self._first_in[window_s] = (g, now)
        n = self.total_completions - g
        if n == 0:
            return None, None
        p0, o0 = cum[g - base - 1] if g > base else self._trimmed
        return (self._sum_p - p0) / n, (self._sum_o - o0) / n

    def _scan_means(self, now: float, window_s: float) -> tuple[float | None, float | None]:
        rec = self.recent(now, window_s)
        if not rec:
            return None, None
        return (sum(c.prompt_tokens for c in rec) / len(rec), sum(c.output_tokens for c in rec) / len(rec))

    def arrival_series(self, now: float, bin_s: float, bins: int) -> list[float]:
        """Arrival rate (req/s) in each of the last `bins` bins of `bin_s` seconds, oldest first.

        The series starts when the window began observing (`observed_since`: the simulation's start, the live
        controller's; without it, the first arrival), or at the oldest bin when that is older: bins before it
        were never observed, and counting them as zero arrivals made a moving average ~5x low at a scaler's
        first decision. Bins after it are observed, arrivals or not. The oldest observed bin's rate is over its
        observed part; one observed for under half a bin is folded into the next, and with under half a bin
        observed in all the series is empty: no forecast yet. Before the first arrival there is no forecast.
        """
        first = self.first_arrival_s
        if first is None or first > now or bin_s <= 0 or bins < 1:
            return []
        if self.observed_since is not None:
            first = min(first, self.observed_since)
        start = now - bin_s * bins
        counts = [0] * bins
        for t, _ in reversed(self.arrivals):
            if t < start:
                break
            counts[min(int((t - start) // bin_s), bins - 1)] += 1
        seen_from = max(start, first)
        k0 = min(int((seen_from - start) // bin_s), bins - 1)
        span = start + (k0 + 1) * bin_s - seen_from  # the observed part of the oldest observed bin
        if span < 0.5 * bin_s:
            if k0 == bins - 1:
                return []
            counts[k0 + 1] += counts[k0]
            span += bin_s
            k0 += 1
        return [counts[k0] / span] + [c / bin_s for c in counts[k0 + 1:]]
