"""Prefix hashing and KV events in the live controller: vLLM's hashes mapped to the proxy's token-id chain."""

import asyncio
import socket

import pytest

pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from live.hashing import ROOT_HASH, block_hash, chain_hashes  # noqa: E402
from live.kv_subscriber import HashTranslator, KVEventSubscriber  # noqa: E402
from twin.policy.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from twin.policy.prefix_index import PreciseIndex  # noqa: E402


def test_chain_hashes_full_blocks_and_shared_prefixes():
    a = list(range(10))
    assert len(chain_hashes(a, 4)) == 2  # the partial last block is not hashed (vLLM caches full blocks)
    b = a[:8] + [99, 98]
    assert chain_hashes(a, 4) == chain_hashes(b, 4)
    c = [0] + a[1:]
    c[1] = 42
    assert chain_hashes(c, 4)[0] != chain_hashes(a, 4)[0]
    assert chain_hashes(c, 4)[1] != chain_hashes(a, 4)[1]  # chained: a different first block changes the second
    assert chain_hashes(a, 4)[0] == block_hash(ROOT_HASH, a[:4])
    with pytest.raises(ValueError):
        chain_hashes(a, 0)


def vllm_stored(hashes, parent, tokens, bs=4):
    return BlockStored(hashes, parent, tokens, bs)


def test_translator_maps_vllm_hashes_to_the_request_chain():
    toks = list(range(100, 112))
    ours = chain_hashes(toks, 4)
    tr = HashTranslator()
    ev = tr.stored(vllm_stored([0xA1, 0xA2], None, toks[:8]))
    assert list(ev.block_hashes) == ours[:2]
    ev2 = tr.stored(vllm_stored([0xA3], 0xA2, toks[8:12]))  # a later event continues from its parent
    assert list(ev2.block_hashes) == ours[2:]
    assert tr.stored(vllm_stored([0xB2], 0xB1, toks[4:8])) is None  # parent never seen
    assert tr.unmapped_blocks == 1
    assert list(tr.removed(BlockRemoved([0xA3, 0xFF])).block_hashes) == [ours[2]]


def test_precise_index_from_translated_events_and_copies():
    idx = PreciseIndex()
    sub = KVEventSubscriber.__new__(KVEventSubscriber)  # the socket-free core
    sub.index, sub.metrics, sub.on_event, sub.translators = idx, None, None, {}
    toks = list(range(16))
    prefix = chain_hashes(toks, 4)
    sub.apply("w0", [vllm_stored([1, 2, 3, 4], None, toks)])
    sub.apply("w1", [vllm_stored([7, 8], None, toks[:8])])
    assert idx.match(prefix, ["w0", "w1"]) == {"w0": 4, "w1": 2}
    sub.apply("w0", [vllm_stored([11], None, toks[:4])])  # a second cached copy of block 0 (another vLLM hash)
    sub.apply("w0", [BlockRemoved([1])])
    assert idx.match(prefix, ["w0"]) == {"w0": 4}  # one copy remains
    sub.apply("w0", [BlockRemoved([11])])
    assert idx.match(prefix, ["w0"]) == {}
    sub.apply("w1", [AllBlocksCleared()])
    assert idx.match(prefix, ["w1"]) == {}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_subscriber_binds_and_reads_vllm_frames():
    """A PUB socket that connects, as vLLM's ZmqEventPublisher does, with its frame layout and payload."""
    import time

    import zmq
    import zmq.asyncio

    from live.metrics import ControllerMetrics

    async def main():
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        idx = PreciseIndex()
        m = ControllerMetrics()
        sub = KVEventSubscriber(idx, m)
        sub.subscribe("w0", endpoint)
        pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
        pub.connect(endpoint)
        toks = list(range(8))
        events = [{"type": "BlockStored", "block_hashes": [b"\x01" * 32, b"\x02" * 32], "parent_block_hash": None,
                   "token_ids": toks, "block_size": 4, "lora_id": None, "medium": "GPU"}]
        got = False
        for seq in range(200):  # the slow-joiner: resend until the subscription is up
            payload = msgpack.packb([time.time(), events, 0])
            await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
            if await sub.wait_first("w0", 0.05):
                got = True
                break
        before = idx.match(chain_hashes(toks, 4), ["w0"])
        pub.close(0)
        sub.close()
        return got, before, idx, m, chain_hashes(toks, 4)

    got, before, idx, m, prefix = asyncio.run(main())
    assert got
    assert before == {"w0": 2}
    assert idx.match(prefix, ["w0"]) == {}  # unsubscribe forgets the worker's blocks
    page = m.render().decode()
    assert 'llmtwin_kv_events_total{type="BlockStored",worker="w0"}' in page
    assert "llmtwin_kv_event_lag_seconds" in page


def test_a_new_subscriber_binds_the_endpoint_a_closed_one_just_released():
    """Issue 10's flaky start-up check: a controller stopped and the next one bound the same endpoints at once.
    With the process-wide ZMQ context the close was asynchronous and the rebind failed (EADDRINUSE) about a
    third of the time; the subscriber's own context is terminated on close, so every rebind succeeds."""

    async def main():
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        states = []
        for _ in range(50):
            sub = KVEventSubscriber(PreciseIndex(), bind_retry_s=0.0)
            sub.subscribe("w0", endpoint)
            states.append(sub.state("w0") if await sub.wait_bound("w0", 1.0) else "not bound")
            sub.close()
        return states

    states = asyncio.run(main())
    assert set(states) == {"no event yet"}, states


def test_a_port_in_use_is_retried_then_reported():
    from live.metrics import ControllerMetrics

    async def main():
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        endpoint = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
        m = ControllerMetrics()
        sub = KVEventSubscriber(PreciseIndex(), m, bind_retry_s=5.0)
        sub.subscribe("w0", endpoint)
        early = sub.state("w0")
        await asyncio.sleep(0.2)
        holder.close()  # released while the subscriber retries
        bound = await sub.wait_bound("w0", 5.0)
        late = sub.state("w0")
        sub.close()
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        sub2 = KVEventSubscriber(PreciseIndex(), m, bind_retry_s=0.3)
        sub2.subscribe("w1", f"tcp://127.0.0.1:{held.getsockname()[1]}")
        never = await sub2.wait_bound("w1", 2.0)
        failed = sub2.state("w1")
        sub2.close()
        held.close()
        return early, bound, late, never, failed, m.render().decode()

    early, bound, late, never, failed, page = asyncio.run(main())
    assert early == "binding" and bound and late == "no event yet"
    assert not never and failed.startswith("bind failed") and "in use" in failed
    assert 'llmtwin_kv_events_arriving{worker="w0"} 0.0' in page
