"""Replay controls shared by every trace format: time window, rate scaling, sampling, a cap, filters, seed.

Every request a control removes is counted in `TraceStats.rows_filtered` with a note saying which
control removed it, so `rows_read == rows_used + rows_filtered + rows_skipped` for per-request traces.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from twin.errors import TwinInputError
from twin.workload.stream import RequestStream, TraceStats
from twin.workload.synthetic import gamma_arrivals, poisson_arrivals


@dataclass
class ReplayControls:
    """Which part of a trace to replay and how fast.

    Times are on the trace's clock, which in every format starts at the trace's first request: each reader
    shifts its timestamps so (Azure, BurstGPT, Mooncake: the first readable row; ShareGPT and length CSVs:
    the first drawn arrival; ServeGen: the start of the chosen clients' first active window, in which the
    first request falls). So `start_s` (`--start`) is seconds after the trace's first request everywhere."""

    start_s: float = 0.0  # window start: seconds after the trace's first request
    duration_s: float | None = None  # window length; None: to the end
    rate_scale: float | None = None  # replay k times as fast (arrival times divided by k)
    target_rate: float | None = None  # or: scale so the mean rate is this many requests/s
    sample: float | None = None  # keep this fraction of requests (whole sessions), chosen at random
    max_requests: int | None = None  # keep at most this many (the first ones)
    max_prompt_tokens: int | None = None  # filter: drop requests with longer prompts
    max_total_tokens: int | None = None  # filter: drop requests with prompt + output above this
    seed: int = 0
    skip_bad_rows: bool = False

    def check(self) -> "ReplayControls":
        def need(ok: bool, name: str, rule: str, value) -> None:
            if not ok:
                raise TwinInputError(f"replay control {name}: must be {rule} (got {value!r})")

        need(self.start_s >= 0, "start_s", ">= 0", self.start_s)
        for name in ("duration_s", "rate_scale", "target_rate", "max_requests", "max_prompt_tokens",
                     "max_total_tokens"):
            v = getattr(self, name)
            need(v is None or v > 0, name, "> 0", v)
        need(self.sample is None or 0 < self.sample <= 1, "sample", "a fraction in (0, 1]", self.sample)
        if self.rate_scale is not None and self.target_rate is not None:
            raise TwinInputError("replay controls rate_scale and target_rate: give one, not both")
        return self

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass
class ArrivalProcess:
    """Arrival times for traces without timestamps (ShareGPT, length CSVs): Poisson, or Gamma with a CV."""

    process: str = "poisson"
    rate: float | None = None
    cv: float = 1.0

    def times(self, n: int, rng: np.random.Generator, fmt: str) -> np.ndarray:
        if self.rate is None:
            raise TwinInputError(f"{fmt} traces have no timestamps: give an arrival rate "
                                 "(--rate, or workload.arrival.rate in the scenario)")
        if self.process not in ("poisson", "gamma") or self.rate <= 0 or not 0 < self.cv <= 100:
            raise TwinInputError(f"arrival: need process poisson|gamma, rate > 0, 0 < cv <= 100 "
                                 f"(got {self.process!r}, {self.rate!r}, {self.cv!r})")
        if self.process == "poisson":
            return poisson_arrivals(n, self.rate, rng)
        return gamma_arrivals(n, self.rate, self.cv, rng)


def step_rng(seed: int, step: str) -> np.random.Generator:
    """An independent generator per step, so changing one control does not reshuffle the others."""
    return np.random.default_rng([seed, sum(map(ord, step)) * 7919 + len(step)])


def subset(stream: RequestStream, keep: np.ndarray) -> RequestStream:
    """The requests where `keep` is True, in order, with the same stats object."""
    idx = np.flatnonzero(keep)
    return RequestStream(
        stream.arrival_s[idx], stream.prompt_tokens[idx], stream.output_tokens[idx],
        None if stream.hash_ids is None else [stream.hash_ids[i] for i in idx], stream.hash_block_size,
        stream.hashes_cover_output, None if stream.session_id is None else np.asarray(stream.session_id)[idx],
        stream.stats, texts=None if stream.texts is None else [stream.texts[i] for i in idx],
    )


def _drop(stream: RequestStream, keep: np.ndarray, why: str, per_request: bool) -> RequestStream:
    n = int((~keep).sum())
    if n == 0:
        return stream
    st = stream.stats
    if per_request:
        st.rows_filtered += n
    st.notes.append(f"{n} {'requests' if per_request else 'generated requests'} left out: {why}")
    out = subset(stream, keep)
    if per_request:
        st.rows_used = len(out)
    return out


def filter_lengths(stream: RequestStream, c: ReplayControls, per_request: bool = True) -> RequestStream:
    """Drop requests over the prompt or total length limits the user set."""
    if c.max_prompt_tokens is not None:
        stream = _drop(stream, stream.prompt_tokens <= c.max_prompt_tokens,
                       f"prompt over max_prompt_tokens {c.max_prompt_tokens}", per_request)
    if c.max_total_tokens is not None:
        stream = _drop(stream, stream.prompt_tokens + stream.output_tokens <= c.max_total_tokens,
                       f"prompt + output over max_total_tokens {c.max_total_tokens}", per_request)
    return stream


def sample_keep(n: int, frac: float, rng: np.random.Generator, session_id: np.ndarray | None) -> np.ndarray:
    """Bernoulli(frac) per request, or per session when requests belong to sessions (sessions stay whole)."""
    if session_id is None:
        return rng.random(n) < frac
    uniq, inv = np.unique(np.asarray(session_id), return_inverse=True)
    return (rng.random(len(uniq)) < frac)[inv]


def window(stream: RequestStream, c: ReplayControls, per_request: bool = True) -> RequestStream:
    """Keep [start_s, start_s + duration_s) and make times relative to start_s; with no window given,
    times start at the first request."""
    if c.start_s > 0 or c.duration_s is not None:
        end = np.inf if c.duration_s is None else c.start_s + c.duration_s
        keep = (stream.arrival_s >= c.start_s) & (stream.arrival_s < end)
        stream = _drop(stream, keep, f"outside the window [{c.start_s:g}, {end:g}) s", per_request)
        stream.arrival_s = stream.arrival_s - c.start_s
    elif len(stream):
        stream.arrival_s = stream.arrival_s - stream.arrival_s[0]
    return stream


def mean_rate(arrival_s: np.ndarray) -> float | None:
    """Requests per second over the span from the first to the last arrival (None if undefined)."""
    if len(arrival_s) < 2 or arrival_s[-1] <= arrival_s[0]:
        return None
    return (len(arrival_s) - 1) / float(arrival_s[-1] - arrival_s[0])


def scale_rate(stream: RequestStream, c: ReplayControls) -> RequestStream:
    """Compress (or stretch) time: k times the rate, same order and burst shape."""
    k = c.rate_scale
    if c.target_rate is not None:
        r = mean_rate(stream.arrival_s)
        if r is None:
            raise TwinInputError("target_rate: the replayed requests span no time (fewer than 2 distinct "
                                 "arrival times), so their rate cannot be scaled")
        k = c.target_rate / r
        stream.stats.notes.append(f"mean rate {r:.3g} req/s scaled x{k:.4g} to the target {c.target_rate:g} req/s")
    elif k is not None:
        stream.stats.notes.append(f"rate scaled x{k:g} (arrival times divided by {k:g})")
    if k is not None:
        stream.arrival_s = stream.arrival_s / k
    return stream


def apply_controls(stream: RequestStream, c: ReplayControls, *, timed: bool = True,
                   per_request: bool = True, windowed: bool = False) -> RequestStream:
    """Filters, window, sampling, rate scaling and cap, in that order, each counted in the stats.

    `timed`: the trace has real timestamps (for untimed traces sampling and the cap happen before
    arrival times are drawn, see `select_rows`). `per_request`: rows of the source are requests
    (ServeGen rows are window statistics, so there removals go to the notes only). `windowed`: the
    reader already cut the time window (ServeGen generates only inside it).
    """
    if len(stream) and stream.stats.span_s is None:  # before any control: what the trace itself spans
        stream.stats.span_s = float(stream.arrival_s[-1] - min(stream.arrival_s[0], 0.0))
    stream = filter_lengths(stream, c, per_request)
    if not windowed:
        stream = window(stream, c, per_request)
    if timed and c.sample is not None and c.sample < 1:
        keep = sample_keep(len(stream), c.sample, step_rng(c.seed, "sample"), stream.session_id)
        stream = _drop(stream, keep, f"random sample of {c.sample:g} (seed {c.seed})", per_request)
    stream = scale_rate(stream, c)
    if timed and c.max_requests is not None and len(stream) > c.max_requests:
        keep = np.arange(len(stream)) < c.max_requests
        stream = _drop(stream, keep, f"after the first max_requests {c.max_requests}", per_request)
    if per_request:
        stream.stats.rows_used = len(stream)
    return stream


def select_rows(n: int, session: np.ndarray, c: ReplayControls, stats: TraceStats, shuffle: bool) -> np.ndarray:
    """For untimed traces: which rows to use and in what order (sample, shuffle, cap), before arrivals exist.

    Rows of one session stay together and in turn order. Returns row indices.
    """
    uniq, first = np.unique(session, return_index=True)
    order = uniq[np.argsort(first, kind="stable")]  # sessions in file order
    if c.sample is not None and c.sample < 1:
        keep = step_rng(c.seed, "sample").random(len(order)) < c.sample
        dropped = int(np.isin(session, order[~keep]).sum())
        if dropped:
            stats.rows_filtered += dropped
            stats.notes.append(f"{dropped} requests left out: random sample of {c.sample:g} (seed {c.seed})")
        order = order[keep]
    if shuffle:
        order = order[step_rng(c.seed, "shuffle").permutation(len(order))]
        stats.notes.append(f"file order shuffled (seed {c.seed}): rows are independent samples")
    pos = {s: i for i, s in enumerate(order.tolist())}
    rank = np.array([pos.get(s, -1) for s in session.tolist()], dtype=np.int64)
    idx = np.flatnonzero(rank >= 0)
    idx = idx[np.argsort(rank[idx], kind="stable")]
    if c.max_requests is not None and len(idx) > c.max_requests:
        cut = len(idx) - c.max_requests
        stats.rows_filtered += cut
        stats.notes.append(f"{cut} requests left out: after the first max_requests {c.max_requests}")
        idx = idx[: c.max_requests]
    return idx


def session_arrivals(session: np.ndarray, starts: np.ndarray, think_time_s: float,
                     rng: np.random.Generator) -> np.ndarray:
    """Arrival per row: a session's first turn at its start time, each later turn an exponential think
    time after the previous one (open loop, as `sessionize` does). `session` must be grouped."""
    t = np.empty(len(session))
    k = -1
    prev = None
    now = 0.0
    for i, s in enumerate(session.tolist()):
        if s != prev:
            k += 1
            now = float(starts[k])
            prev = s
        elif think_time_s > 0:
            now += float(rng.exponential(think_time_s))
        t[i] = now
    return t
