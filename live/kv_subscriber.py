"""vLLM's KV events over ZMQ into the precise prefix index, with vLLM's block hashes mapped to the proxy's.

vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`) sends multipart frames (topic, 8-byte
big-endian sequence number, msgpack `[ts, [events...], dp_rank]`). An endpoint `tcp://HOST:PORT` makes the
publisher *connect*, so the controller *binds* one SUB socket per worker and knows whose events it reads.

Hash mapping (see `live.hashing`): each `BlockStored` carries its blocks' `token_ids` and the vLLM hash of
the block before them; `HashTranslator` chains the proxy's hash over those tokens from the parent's mapped
hash, remembers vLLM hash -> proxy hash (with copy counts, as vLLM reports each cached copy), and hands the
precise index events in the proxy's hashes, the ones `RequestView.prefix` carries.

Binding: the subscriber has its own ZMQ context, terminated on `close()`. libzmq closes a socket (and its
listening TCP port) asynchronously, in its I/O thread; with the process-wide `Context.instance()` a
controller that stopped and a new one that bound the same endpoint at once got EADDRINUSE about a third of
the time (measured in a loop), and then no KV event ever (the flaky start-up check in issue 10). `term()`
returns only once the ports are released. A bind that still finds the port taken (a worker relaunched in a
retired slot, whose socket closed asynchronously) is retried for `bind_retry_s` before it is reported.
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
                 on_event: Callable[[str, KVEvent], None] | None = None, bind_retry_s: float = 10.0) -> None:
        import zmq.asyncio

        self.index = index
        self.metrics = metrics
        self.on_event = on_event
        self.bind_retry_s = bind_retry_s
        self.ctx = zmq.asyncio.Context()  # our own: term() releases the bound ports before close() returns
        self.translators: dict[str, HashTranslator] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.sockets: dict[str, Any] = {}
        self.endpoints: dict[str, str] = {}
        self.last_seq: dict[str, int] = {}
        self.lag_s: dict[str, float] = {}
        self.batches: dict[str, int] = {}
        self.bound: dict[str, asyncio.Event] = {}
        self.first_event: dict[str, asyncio.Event] = {}
        self.bind_error: dict[str, str] = {}

    def subscribe(self, worker_id: str, endpoint: str) -> None:
        """Bind `endpoint` (the worker's publisher connects to it) and start reading.

        A malformed endpoint raises at once; a port still in use is retried in the background."""
        import zmq

        if worker_id in self.sockets or worker_id in self.tasks:
            return
        self.endpoints[worker_id] = endpoint
        self.translators[worker_id] = HashTranslator()
        self.first_event[worker_id] = asyncio.Event()
        self.bound[worker_id] = asyncio.Event()
        self.batches[worker_id] = 0
        if self.metrics is not None:
            self.metrics.kv_events_arriving.labels(worker_id).set(0)
        try:
            sock = self._bind(endpoint)
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                self._forget(worker_id)
                raise
            if self.bind_retry_s <= 0:
                self.bind_error[worker_id] = str(e)
                log.error("worker %s: cannot bind KV-event endpoint %s: %s (no KV events from it)", worker_id,
                          endpoint, e)
                return
            log.warning("worker %s: KV-event endpoint %s is in use; retrying the bind for %.0f s", worker_id,
                        endpoint, self.bind_retry_s)
            sock = None
        self.tasks[worker_id] = asyncio.get_running_loop().create_task(self._run(worker_id, endpoint, sock))

    def _bind(self, endpoint: str) -> Any:
        import zmq

        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: the socket is this worker's alone
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(0)
            raise
        return sock

    async def _run(self, worker_id: str, endpoint: str, sock: Any) -> None:
        import zmq

        delay = 0.05
        deadline = time.monotonic() + self.bind_retry_s
        while sock is None:
            try:
                if time.monotonic() >= deadline:
                    sock = self._bind(endpoint)  # the last try: its error is the one reported
                else:
                    await asyncio.sleep(delay)
                    delay = min(1.0, 2 * delay)
                    sock = self._bind(endpoint)
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    self.bind_error[worker_id] = str(e)
                    log.error("worker %s: cannot bind KV-event endpoint %s: %s (no KV events from it)",
                              worker_id, endpoint, e)
                    return
        self.sockets[worker_id] = sock
        self.bound[worker_id].set()
        await self._read(worker_id, sock)

    async def _read(self, worker_id: str, sock: Any) -> None:
        from twin.policy.kv_events import decode_batch

        m = self.metrics
        first = self.first_event[worker_id]
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
            if not first.is_set():
                first.set()
                if m is not None:
                    m.kv_events_arriving.labels(worker_id).set(1)

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
        return await self._wait(self.first_event.get(worker_id), timeout_s)

    async def wait_bound(self, worker_id: str, timeout_s: float) -> bool:
        """True once the SUB socket is bound (a publisher's messages can reach it from then on)."""
        return await self._wait(self.bound.get(worker_id), timeout_s)

    @staticmethod
    async def _wait(ev: asyncio.Event | None, timeout_s: float) -> bool:
        if ev is None:
            return False
        if ev.is_set():
            return True
        try:
            await asyncio.wait_for(ev.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def state(self, worker_id: str) -> str:
        """What an operator reads first: bind failed, waiting for the first batch, or receiving."""
        if worker_id in self.bind_error:
            return "bind failed: " + self.bind_error[worker_id]
        if worker_id not in self.endpoints:
            return "off"
        ev = self.first_event.get(worker_id)
        if ev is not None and ev.is_set():
            return "receiving"
        b = self.bound.get(worker_id)
        return "no event yet" if b is not None and b.is_set() else "binding"

    def _forget(self, worker_id: str) -> None:
        for d in (self.translators, self.endpoints, self.first_event, self.bound, self.batches, self.last_seq,
                  self.lag_s, self.bind_error):
            d.pop(worker_id, None)

    def unsubscribe(self, worker_id: str) -> None:
        t = self.tasks.pop(worker_id, None)
        if t is not None:
            t.cancel()
        s = self.sockets.pop(worker_id, None)
        if s is not None:
            s.close(0)
        self._forget(worker_id)
        self.index.remove_instance(worker_id)

    def close(self) -> None:
        """Close every socket and terminate the context: the endpoints are free when this returns."""
        for wid in set(self.endpoints) | set(self.sockets):
            self.unsubscribe(wid)
        if not self.ctx.closed:
            self.ctx.term()
