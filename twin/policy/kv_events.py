"""KV-cache events in vLLM's schema (`vllm/distributed/kv_events.py`): what a precise prefix index consumes.

vLLM publishes them over ZMQ as msgpack `[ts, [events...], dp_rank]`; the twin's block pool emits the same
values in process. `token_ids` is None in the twin (it counts tokens, it has no ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks were hashed and cached; `parent_block_hash` is the block before the first one."""

    block_hashes: Sequence[int]
    parent_block_hash: int | None = None
    token_ids: Sequence[int] | None = None
    block_size: int = 16
    lora_id: int | None = None
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted (one event per evicted copy)."""

    block_hashes: Sequence[int]
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The instance dropped its whole prefix cache (reset, restart)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """Events of one instance published together at time `ts`."""

    ts: float
    events: Sequence[KVEvent] = field(default_factory=tuple)
    data_parallel_rank: int | None = None


def _as_int_hash(h: Any) -> int:
    """vLLM hashes are bytes (sha256) or ints depending on the version; index them as ints."""
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h, "big")
    return int(h)


def decode_event(raw: Any) -> KVEvent:
    """One event from its msgpack form: a map with "type", or msgspec's tagged array `[type, fields...]`."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        get = raw.get
    elif isinstance(raw, (list, tuple)) and raw:
        kind = raw[0]
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                 "medium"),
                 "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}.get(kind, ())
        vals = dict(zip(names, raw[1:]))
        get = vals.get
    else:
        raise ValueError(f"not a KV event: {raw!r:.80}")
    if kind == "BlockStored":
        parent = get("parent_block_hash")
        return BlockStored([_as_int_hash(h) for h in get("block_hashes") or []],
                           None if parent is None else _as_int_hash(parent), get("token_ids"),
                           int(get("block_size") or 0), get("lora_id"), get("medium"))
    if kind == "BlockRemoved":
        return BlockRemoved([_as_int_hash(h) for h in get("block_hashes") or []], get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


def decode_batch(payload: bytes) -> KVEventBatch:
    """A ZMQ payload (msgpack `[ts, [events...], dp_rank]`) as a batch; needs the `[live]` extra (msgpack)."""
    import msgpack

    raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(raw, (list, tuple)) or len(raw) < 2:
        raise ValueError("KV event payload is not [ts, events, dp_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    return KVEventBatch(float(ts), tuple(decode_event(e) for e in events), rank)
