"""Hand-made views for policy unit tests: what a router sees, without a simulator."""

from __future__ import annotations

from twin.policy import Bookkeeping, FleetView, Gauges, InstanceConfig, InstanceView, RequestView


def fleet_of(*specs, now: float = 0.0, index=None, block_size: int = 16, num_gpu_blocks: int = 1000,
             bookkeeping: Bookkeeping | None = None) -> FleetView:
    """specs: dicts with id and any of running, waiting, kv, inflight, prompt, decode, state, started_at."""
    books = bookkeeping or Bookkeeping()
    views = []
    for s in specs:
        ld = books.load(s["id"])
        ld.requests = s.get("inflight", ld.requests)
        ld.prompt_tokens = s.get("prompt", ld.prompt_tokens)
        ld.decode_tokens = s.get("decode", ld.decode_tokens)
        views.append(InstanceView(
            s["id"], s.get("state", "serving"),
            Gauges(s.get("running", 0), s.get("waiting", 0), s.get("kv", 0.0), now),
            InstanceConfig(num_gpu_blocks, block_size, s.get("max_num_seqs", 256), 8192, 8192), ld,
            s.get("started_at", -1e9)))
    return FleetView(now, [v for v in views if v.state == "serving"], books, index, all_instances=views)


def req(i: int = 0, prompt: int = 100, prefix=(), session=None, t: float = 0.0, **kw) -> RequestView:
    return RequestView(str(i), t, prompt, None, tuple(prefix), 16, session, **kw)
