"""vLLM's KV events over ZMQ into the precise prefix index, with vLLM's block hashes mapped to the proxy's.

vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`) sends multipart frames (topic, 8-byte
big-endian sequence number, msgpack `[ts, [events...], dp_rank]`). An endpoint `tcp://HOST:PORT` makes the
publisher *connect*, so the controller *binds* one SUB socket per worker and knows whose events it reads.

Hash mapping (see `live.hashing`): each `BlockStored` carries its blocks' `token_ids` and the vLLM hash of
the block before them; `HashTranslator` chains the proxy's hash over those tokens from the parent's mapped
hash, remembers vLLM hash -> proxy hash (with copy counts, as vLLM reports each cached copy), and hands the
precise index events in the proxy's hashes, the ones `RequestView.prefix` carries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from twin.policy.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from twin.policy.prefix_index import PreciseIndex

from live.hashing import ROOT_HASH, block_hash

log = logging.getLogger("llmtwin.live")


class HashTranslator:
    """vLLM block hash -> the proxy's chained token-id hash, for one worker."""

    def __init__(self) -> None:
        self._map: dict[int, list[int]] = {}  # vllm hash -> [proxy hash, copies]
        self.unmapped_blocks = 0

    def stored(self, ev: BlockStored) -> BlockStored | None:
        """The event in proxy hashes; None when its parent was never seen (blocks stored before we listened)."""
        if ev.token_ids is None or not ev.block_hashes:
            self.unmapped_blocks += len(ev.block_hashes)
            return None
        if ev.parent_block_hash is None:
            parent = ROOT_HASH
        else:
            rec = self._map.get(ev.parent_block_hash)
            if rec is None:
                self.unmapped_blocks += len(ev.block_hashes)
                return None
            parent = rec[0]
        bs = ev.block_size or (len(ev.token_ids) // len(ev.block_hashes))
        toks = ev.token_ids
        ours = []
        for i, vh in enumerate(ev.block_hashes):
            parent = block_hash(parent, toks[i * bs:(i + 1) * bs])
            ours.append(parent)
            rec = self._map.get(vh)
            if rec is None:
                self._map[vh] = [parent, 1]
            else:
                rec[1] += 1
        return BlockStored(ours, None, None, bs, ev.lora_id, ev.medium)

    def removed(self, ev: BlockRemoved) -> BlockRemoved:
        ours = []
        for vh in ev.block_hashes:
            rec = self._map.get(vh)
            if rec is None:
                continue
            ours.append(rec[0])
            rec[1] -= 1
            if rec[1] <= 0:
                del self._map[vh]
        return BlockRemoved(ours, ev.medium)

    def cleared(self) -> None:
        self._map.clear()

    def __len__(self) -> int:
        return len(self._map)


class KVEventSubscriber:
    """One bound SUB socket per worker; applies its events to `index` and tracks lag and gaps."""

    def __init__(self, index: PreciseIndex, metrics: Any = None,
                 on_event: Callable[[str, KVEvent], None] | None = None) -> None:
        import zmq.asyncio

        self.index = index
        self.metrics = metrics
        self.on_event = on_event
        self.ctx = zmq.asyncio.Context.instance()
        self.translators: dict[str, HashTranslator] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.sockets: dict[str, Any] = {}
        self.last_seq: dict[str, int] = {}
        self.lag_s: dict[str, float] = {}
        self.batches: dict[str, int] = {}
        self.first_event: dict[str, asyncio.Event] = {}

    def subscribe(self, worker_id: str, endpoint: str) -> None:
        """Bind `endpoint` (the worker's publisher connects to it) and start reading."""
        import zmq

        if worker_id in self.sockets:
            return
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.bind(endpoint)
        self.sockets[worker_id] = sock
        self.translators[worker_id] = HashTranslator()
        self.first_event[worker_id] = asyncio.Event()
        self.batches[worker_id] = 0
        self.tasks[worker_id] = asyncio.get_running_loop().create_task(self._read(worker_id, sock))

    async def _read(self, worker_id: str, sock: Any) -> None:
        from twin.policy.kv_events import decode_batch

        m = self.metrics
        while True:
            frames = await sock.recv_multipart()
            try:
                payload = frames[-1]
                if len(frames) >= 3:
                    seq = int.from_bytes(frames[1], "big")
                    prev = self.last_seq.get(worker_id)
                    if prev is not None and seq > prev + 1 and m is not None:
                        m.kv_event_gaps.labels(worker_id).inc(seq - prev - 1)
                    self.last_seq[worker_id] = seq
                batch = decode_batch(payload)
            except Exception as e:  # noqa: BLE001 - a bad frame is counted, never fatal
                log.warning("worker %s: undecodable KV-event frame: %s", worker_id, e)
                continue
            lag = time.time() - batch.ts
            self.lag_s[worker_id] = lag
            self.batches[worker_id] += 1
            if m is not None:
                m.kv_event_lag.labels(worker_id).set(lag)
            try:
                self.apply(worker_id, batch.events, batch.ts)
            except Exception:  # noqa: BLE001 - a bug here must not silently end the reader
                log.exception("worker %s: applying KV events failed", worker_id)
            self.first_event[worker_id].set()

    def apply(self, worker_id: str, events: Any, ts: float | None = None) -> None:
        """Translate and apply one batch's events (also the unit-testable core, no socket needed)."""
        tr = self.translators.setdefault(worker_id, HashTranslator())
        m = self.metrics
        before = tr.unmapped_blocks
        for ev in events:
            kind = type(ev).__name__
            if type(ev) is BlockStored:
                ours = tr.stored(ev)
                if ours is not None:
                    self.index.apply(worker_id, ours, ts)
            elif type(ev) is BlockRemoved:
                self.index.apply(worker_id, tr.removed(ev), ts)
            elif type(ev) is AllBlocksCleared:
                tr.cleared()
                self.index.apply(worker_id, ev, ts)
            if m is not None:
                m.kv_events.labels(worker_id, kind).inc()
            if self.on_event is not None:
                self.on_event(worker_id, ev)
        if m is not None and tr.unmapped_blocks > before:
            m.kv_events_unmapped.labels(worker_id).inc(tr.unmapped_blocks - before)

    async def wait_first(self, worker_id: str, timeout_s: float) -> bool:
        ev = self.first_event.get(worker_id)
        if ev is None:
            return False
        try:
            await asyncio.wait_for(ev.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def unsubscribe(self, worker_id: str) -> None:
        t = self.tasks.pop(worker_id, None)
        if t is not None:
            t.cancel()
        s = self.sockets.pop(worker_id, None)
        if s is not None:
            s.close(0)
        self.translators.pop(worker_id, None)
        self.index.remove_instance(worker_id)

    def close(self) -> None:
        for wid in list(self.sockets):
            self.unsubscribe(wid)
