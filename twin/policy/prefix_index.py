"""Where is which prefix cached? Two indexes behind one question, both used by the twin and the live proxy.

- `ApproxPrefixIndex` remembers where the router sent which prefix blocks (llm-d's approximate prefix
  scorer): bounded by an LRU of blocks per instance, so memory stays flat however many prefixes pass.
- `PreciseIndex` is fed by the instances' KV events (`BlockStored`/`BlockRemoved`/`AllBlocksCleared`), so it
  knows what each instance really holds, as of the event delay. It counts copies, as vLLM keeps duplicate
  cached blocks under one hash (`BlockHashToBlockMap` in `vllm/v1/core/block_pool.py`) and reports each.

Both answer `match(prefix, instance_ids) -> {instance: leading blocks cached}` (instances with 0 omitted).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Protocol, Sequence

from twin.policy.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class PrefixIndex(Protocol):
    kind: str

    def match(self, prefix: Sequence[int], instance_ids: Iterable[str]) -> dict[str, int]:
        """Leading blocks of `prefix` cached on each of `instance_ids` (those with none are left out)."""
        ...

    def on_dispatch(self, prefix: Sequence[int], instance_id: str, now: float) -> None: ...

    def remove_instance(self, instance_id: str) -> None: ...


def _leading_match(holders: dict, prefix: Sequence[int], wanted: set[str]) -> dict[str, int]:
    """Walk the chain once, shrinking the set of instances that still hold every block so far."""
    out: dict[str, int] = {}
    if not prefix:
        return out
    first = holders.get(prefix[0])
    if not first:
        return out
    active = [i for i in first if i in wanted]
    j = 1
    n = len(prefix)
    while active and j < n:
        h = holders.get(prefix[j])
        if not h:
            break
        keep = [i for i in active if i in h]
        if len(keep) != len(active):
            for i in active:
                if i not in h:
                    out[i] = j
            active = keep
        j += 1
    for i in active:
        out[i] = j
    return out


class ApproxPrefixIndex:
    """Prefix blocks as the router placed them, an LRU of `capacity_blocks` per instance."""

    kind = "approximate"

    def __init__(self, capacity_blocks: int = 100_000) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def on_dispatch(self, prefix: Sequence[int], instance_id: str, now: float = 0.0) -> None:
        if not prefix:
            return
        lru = self._lru.get(instance_id)
        if lru is None:
            lru = self._lru[instance_id] = OrderedDict()
        holders = self._holders
        for h in prefix:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                s = holders.get(h)
                if s is None:
                    holders[h] = {instance_id}
                else:
                    s.add(instance_id)
        while len(lru) > self.capacity_blocks:
            h, _ = lru.popitem(last=False)
            s = holders[h]
            s.discard(instance_id)
            if not s:
                del holders[h]

    def match(self, prefix: Sequence[int], instance_ids: Iterable[str]) -> dict[str, int]:
        return _leading_match(self._holders, prefix, set(instance_ids))

    def remove_instance(self, instance_id: str) -> None:
        lru = self._lru.pop(instance_id, None)
        for h in lru or ():
            s = self._holders[h]
            s.discard(instance_id)
            if not s:
                del self._holders[h]

    def num_blocks(self) -> int:
        return sum(len(v) for v in self._lru.values())


class PreciseIndex:
    """What each instance holds, from its KV events; a hash stays while any cached copy of it remains."""

    kind = "precise"

    def __init__(self) -> None:
        self._holders: dict[int, dict[str, int]] = {}  # hash -> {instance: copies}
        self._held: dict[str, set[int]] = {}
        self.events_applied = 0
        self.last_event_ts: dict[str, float] = {}

    def apply(self, instance_id: str, event: KVEvent, ts: float | None = None) -> None:
        self.events_applied += 1
        if ts is not None:
            self.last_event_ts[instance_id] = ts
        holders = self._holders
        if type(event) is BlockStored:
            held = self._held.get(instance_id)
            if held is None:
                held = self._held[instance_id] = set()
            for h in event.block_hashes:
                d = holders.get(h)
                if d is None:
                    holders[h] = {instance_id: 1}
                else:
                    d[instance_id] = d.get(instance_id, 0) + 1
                held.add(h)
        elif type(event) is BlockRemoved:
            held = self._held.get(instance_id)
            for h in event.block_hashes:
                d = holders.get(h)
                if d is None or instance_id not in d:
                    continue  # removal of a block stored before we subscribed
                c = d[instance_id] - 1
                if c:
                    d[instance_id] = c
                else:
                    del d[instance_id]
                    if held is not None:
                        held.discard(h)
                    if not d:
                        del holders[h]
        elif type(event) is AllBlocksCleared:
            self.remove_instance(instance_id)
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def on_dispatch(self, prefix: Sequence[int], instance_id: str, now: float = 0.0) -> None:
        """Dispatches teach a precise index nothing: only events do."""

    def match(self, prefix: Sequence[int], instance_ids: Iterable[str]) -> dict[str, int]:
        return _leading_match(self._holders, prefix, set(instance_ids))

    def remove_instance(self, instance_id: str) -> None:
        for h in self._held.pop(instance_id, set()):
            d = self._holders.get(h)
            if d is not None:
                d.pop(instance_id, None)
                if not d:
                    del self._holders[h]

    def num_blocks(self, instance_id: str) -> int:
        return len(self._held.get(instance_id, ()))


PREFIX_INDEXES = {"approximate": ApproxPrefixIndex, "precise": PreciseIndex}


def make_prefix_index(kind: str, **params) -> PrefixIndex:
    if kind not in PREFIX_INDEXES:
        raise KeyError(kind)
    return PREFIX_INDEXES[kind](**params)
