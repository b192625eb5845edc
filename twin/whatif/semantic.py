"""Semantic batch composition: queue compatible waiting requests together, oldest group first.

The claim ("semantic batching gives 2.8x throughput") comes from static batching, where a batch runs until its
longest member ends, so grouping requests of similar output length cuts the padding. vLLM batches
continuously: a finished sequence leaves at once and a waiting one takes its place, so ordering the queue can
only change *which* requests share a step (their prefill/decode mix, their KV footprint), never pad. The twin
measures that on the same arrivals as plain FCFS.

The policy (`semantic_order`) is plain Python over lengths: DBSCAN (scikit-learn) clusters the requests by
(prompt_weight x log(1 + prompt), log(1 + predicted output)); the order takes the oldest request not yet
placed, then every request of its cluster whose predicted output is within `max_new_tokens_ratio` of the
anchor's, in arrival order, and repeats. A request is delayed only behind groups anchored by older requests.

`WaitingQueueOrder` applies it where requests enter an instance's waiting queue (the hook in
`twin.sim.cluster.Cluster.dispatch`), to the never-scheduled tail of that queue only: preempted requests, which
vLLM puts back at the front, keep their place; the engine's scheduler is unchanged and admits the queue in
its (now regrouped) order, as vLLM's FCFS policy would. Predicted output lengths: the client's cap
(`predictor: cap`) or, as an upper bound on what a predictor could give, the true length (`predictor: oracle`,
reported as such).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from twin.errors import TwinInputError


def _dbscan():
    try:
        from sklearn.cluster import DBSCAN
    except ImportError:  # pragma: no cover - the [whatif] extra installs it
        raise TwinInputError("whatif.semantic_batching needs scikit-learn: pip install 'llmtwin[whatif]'") from None
    return DBSCAN


def semantic_order(prompt: Sequence[int], predicted: Sequence[int], eps: float = 0.3, min_samples: int = 1,
                   prompt_weight: float = 1.0, max_new_tokens_ratio: float = 2.0) -> list[int]:
    """A permutation of range(n) (inputs in arrival order) that puts compatible requests next to each other."""
    n = len(prompt)
    if n <= 1:
        return list(range(n))
    import numpy as np

    x = np.column_stack([prompt_weight * np.log1p(np.asarray(prompt, dtype=float)),
                         np.log1p(np.asarray(predicted, dtype=float))])
    labels = _dbscan()(eps=eps, min_samples=min_samples).fit_predict(x).tolist()
    members: dict[int, list[int]] = {}
    for i, lab in enumerate(labels):
        members.setdefault(lab, []).append(i)
    placed = [False] * n
    order: list[int] = []
    for anchor in range(n):
        if placed[anchor]:
            continue
        lab = labels[anchor]
        group = [anchor] if lab < 0 else members[lab]  # DBSCAN noise (-1) stays alone
        a = max(predicted[anchor], 1)
        for j in group:
            if placed[j]:
                continue
            p = max(predicted[j], 1)
            if max(p, a) <= max_new_tokens_ratio * min(p, a):
                placed[j] = True
                order.append(j)
    return order


class WaitingQueueOrder:
    """Regroups an engine's waiting deque in place after each arrival (duck-typed engine requests)."""

    def __init__(self, spec, predict: Callable[[object], int]) -> None:
        self.spec = spec
        self.predict = predict
        _dbscan()  # fail at set-up, not mid-run, without scikit-learn
        self.reorders = 0

    def __call__(self, waiting: deque) -> None:
        # the never-scheduled tail: vLLM puts preempted requests back at the front
        start = 0
        for r in waiting:
            if r.num_preemptions == 0 and r.num_computed_tokens == 0:
                break
            start += 1
        fresh = len(waiting) - start
        if fresh < 2:
            return
        items = list(waiting)
        head, tail = items[:start], items[start:]
        tail.sort(key=lambda r: (r.arrival_time, r.idx))
        window, rest = tail[: self.spec.window], tail[self.spec.window:]
        s = self.spec
        perm = semantic_order([r.num_prompt_tokens for r in window], [self.predict(r) for r in window], s.eps,
                              s.min_samples, s.prompt_weight, s.max_new_tokens_ratio)
        new = head + [window[i] for i in perm] + rest
        if any(a is not b for a, b in zip(new, items)):
            waiting.clear()
            waiting.extend(new)
            self.reorders += 1


def queue_order(sc, max_model_len: int) -> WaitingQueueOrder | None:
    """The scenario's queue-order hook, or None when semantic batching is off."""
    s = sc.whatif.semantic_batching
    if not s.enabled:
        return None
    cap = sc.workload.max_tokens
    if s.predictor == "oracle":
        def predict(r) -> int:  # the true output length (capped by the client's max_tokens): an upper bound
            return int(r.stop_at_tokens)
    else:
        def predict(r) -> int:  # what the client sent: its max_tokens, else vLLM's default
            return int(cap) if cap is not None else max(1, max_model_len - int(r.num_prompt_tokens))
    return WaitingQueueOrder(s, predict)

