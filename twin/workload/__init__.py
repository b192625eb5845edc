"""Workloads: trace readers and synthetic generators, all yielding one `RequestStream`."""

from __future__ import annotations

import numpy as np

from twin.errors import TwinInputError
from twin.workload.formats.common import seconds
from twin.workload.stream import RequestStream, TraceStats
from twin.workload.synthetic import (gamma_arrivals, poisson_arrivals, read_length_trace, sample_lengths,
                                     sessionize)

__all__ = ["RequestStream", "TraceStats", "build_stream", "apply_context_limit", "trace_stream"]


def trace_stream(sc) -> RequestStream:
    """The stream of a scenario whose workload names a trace (paths relative to the scenario file)."""
    from twin.workload.formats import UNTIMED, detect_format, load_trace
    from twin.workload.formats.common import check_file

    t = sc.workload.trace
    path = check_file(sc.resolve_path(t.path), "trace")
    fmt = detect_format(path) if t.format == "auto" else t.format
    opts = t.model_dump(exclude_defaults=True, exclude={"path", "format"})
    for key in ("tokenizer", "output_lengths", "lengths", "answers"):
        if key in opts:
            opts[key] = str(sc.resolve_path(opts[key]))
    a = sc.workload.arrival
    if a is not None and fmt in UNTIMED:
        opts.update(arrival=a.process, rate=a.rate, cv=a.cv)
    stream = load_trace(path, fmt, seed=sc.seed, **opts)
    if a is not None and fmt not in UNTIMED:
        stream.stats.notes.append("workload.arrival ignored: this trace has its own timestamps")
    return stream


def apply_context_limit(stream: RequestStream, max_model_len: int, policy: str, where: str) -> RequestStream:
    """Requests longer than the model's context: an error (default), kept to be rejected, or truncated."""
    total = stream.prompt_tokens + stream.output_tokens
    over = total > max_model_len
    n = int(over.sum())
    if n == 0 or policy == "reject":
        if n:
            stream.stats.notes.append(f"{n} requests exceed max_model_len {max_model_len}: rejected at arrival")
        return stream
    if policy == "error":
        i = int(np.flatnonzero(over)[0])
        raise TwinInputError(
            f"{where}: {n} request(s) longer than the model's context (max_model_len {max_model_len}); "
            f"the first is request {i} with {int(stream.prompt_tokens[i])} prompt + "
            f"{int(stream.output_tokens[i])} output tokens. Set workload.on_too_long to 'reject' or "
            "'truncate', or cap the lengths"
        )
    # truncate: keep the output, cut the prompt from the left (as a chat client drops old turns)
    if max_model_len < 2:  # a request needs a prompt token and an output token
        raise TwinInputError(f"{where}: max_model_len {max_model_len} leaves no room for a prompt token and an "
                             "output token: nothing can be truncated to fit")
    out = np.minimum(stream.output_tokens, max_model_len - 1)
    stream.output_tokens = out
    stream.prompt_tokens = np.minimum(stream.prompt_tokens, max_model_len - out)
    if stream.hash_ids is not None:  # a prompt cut from the left no longer starts with its old prefix
        for i in np.flatnonzero(over):
            stream.hash_ids[i] = None
    stream.stats.notes.append(f"{n} requests truncated to max_model_len {max_model_len}")
    return stream


def assign_priorities(stream: RequestStream, sc) -> RequestStream:
    """Each request's vLLM priority drawn from `workload.priorities` (one draw per session, so a conversation keeps
    its class), from a generator of its own: the stream is otherwise the one the same seed gives without them."""
    classes = sc.workload.priorities
    if not classes:
        return stream
    values = np.array([c.priority for c in classes], dtype=np.int64)
    p = np.array([c.share for c in classes], dtype=np.float64)
    rng = np.random.default_rng([sc.seed, 0x9E1])
    if stream.session_id is not None:
        sid = np.asarray(stream.session_id)
        keys, inverse = np.unique(sid, return_inverse=True)
        drawn = values[rng.choice(len(values), size=len(keys), p=p / p.sum())][inverse]
        alone = sid < 0  # requests outside any session draw on their own
        drawn[alone] = values[rng.choice(len(values), size=int(alone.sum()), p=p / p.sum())]
    else:
        drawn = values[rng.choice(len(values), size=len(stream), p=p / p.sum())]
    stream.priority = drawn
    if sc.cluster.engine.scheduling_policy != "priority" and len(set(values.tolist())) > 1:
        stream.stats.notes.append("workload.priorities are set but cluster.engine.scheduling_policy is fcfs: vLLM "
                                  "ignores request priorities then")
    return stream


def empty_reason(t, stats: TraceStats) -> str:
    """Why a replay came out empty: the window against the trace's time span, or the filters."""
    rows = f"{stats.rows_read:,} rows read, {stats.rows_filtered:,} filtered, {stats.rows_skipped:,} skipped"
    if stats.span_s is None:
        return f"no row became a request ({rows})"
    span = f"the trace's requests span {seconds(stats.span_s)} from its first request"
    if t.start_s > 0 or t.duration_s is not None:
        win = (f"starting {seconds(t.start_s)}" if t.duration_s is None
               else f"{seconds(t.start_s)} to {seconds(t.start_s + t.duration_s)}")
        return f"the window {win} after the first request holds none; {span} ({rows})"
    return f"the filters left none; {span} ({rows})"


MAX_SPAN_S = 1e9  # simulated seconds (~31 years): past this the float clock loses microseconds, and the run its sense


def check_span(stream: RequestStream, where: str, knob: str) -> None:
    """Refuse arrivals spread past `MAX_SPAN_S` (a rate of 1e-18 req/s ran, and reported every latency as 0 ms;
    at 1e-30 the run never ended)."""
    last = float(np.max(stream.arrival_s)) if len(stream) else 0.0
    if not last <= MAX_SPAN_S:
        raise TwinInputError(f"{where}: the arrivals span {last:.3g} s, past {MAX_SPAN_S:.0e} s (about 31 years) of "
                             f"simulated time: check {knob}")


def build_stream(sc) -> RequestStream:
    """The request stream a scenario's `workload` section describes."""
    w = sc.workload
    if w.trace is not None:
        stream = trace_stream(sc)
        if not len(stream):
            raise TwinInputError(f"workload.trace {w.trace.path}: no requests left to replay: "
                                 + empty_reason(w.trace, stream.stats))
        check_span(stream, f"workload.trace {w.trace.path}", "the trace's rate_scale, target_rate or rate")
        max_len = sc.cluster.max_model_len()
        return assign_priorities(apply_context_limit(stream, max_len, w.on_too_long, f"workload.trace {w.trace.path}"),
                                 sc)
    rng = np.random.default_rng(sc.seed)
    n = w.num_requests
    if w.closed_loop is not None:
        arrivals = np.zeros(n)  # the clients send them (twin.workload.closed_loop)
    elif w.arrival.process == "poisson":
        arrivals = poisson_arrivals(n, w.arrival.rate, rng)
    else:
        arrivals = gamma_arrivals(n, w.arrival.rate, w.arrival.cv, rng)
    stats = TraceStats(source="synthetic")
    if w.lengths.kind == "fixed":
        prompt = np.full(n, w.lengths.prompt_tokens, dtype=np.int64)
        output = np.full(n, w.lengths.output_tokens, dtype=np.int64)
    elif w.lengths.kind == "uniform":  # benchmark_serving.py's random dataset: randint(int(L * r), L + 1)
        r = w.lengths.range_ratio
        p_len, o_len = w.lengths.prompt_tokens, w.lengths.output_tokens
        prompt = rng.integers(max(int(p_len * r), 1), p_len + 1, size=n)
        output = rng.integers(max(int(o_len * r), 1), o_len + 1, size=n)
    else:
        path = sc.resolve_path(w.lengths.path)
        p_all, o_all = read_length_trace(path)
        prompt, output, capped = sample_lengths(p_all, o_all, n, rng, w.lengths.max_total_tokens)
        stats = TraceStats(source=f"lengths from {w.lengths.path}", rows_read=len(p_all),
                           rows_used=len(p_all) - capped, rows_filtered=capped)
        if capped:
            stats.notes.append(f"{capped} length rows over max_total_tokens left out of the sampling pool")
        zero = int(np.count_nonzero(o_all == 0))
        if zero:
            stats.notes.append(f"{zero} length rows with num_decode_tokens 0 run with 1 output token (vLLM emits one "
                               "at least)")
    if w.closed_loop is not None:
        from twin.workload.closed_loop import closed_loop_stream

        cl = w.closed_loop
        stream = closed_loop_stream(prompt, output, cl.concurrency, rng, cl.think_time_s, cl.think, cl.ramp_up_s,
                                    stats)
    elif w.sessions is not None:
        stream = sessionize(arrivals, prompt, output, rng, w.sessions.turns_mean, w.sessions.think_time_s,
                            closed_loop=w.sessions.closed_loop)
        stream.stats = stats
    else:
        stream = RequestStream(arrivals, prompt, output, stats=stats)
    check_span(stream, "workload", "workload.arrival.rate" + (" and sessions.think_time_s" if w.sessions else ""))
    max_len = sc.cluster.max_model_len()
    return assign_priorities(apply_context_limit(stream, max_len, w.on_too_long, "workload"), sc)
