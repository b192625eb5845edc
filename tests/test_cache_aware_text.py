"""The cache-aware (SGLang) router on traces without prefix hashes (issue 21): prefixes from the prompt text."""

import numpy as np
import pytest

from twin.sim.cluster import Cluster
from twin.policy import ApproxPrefixIndex, CacheAware
from twin.workload.text_prefix import text_block_ids, with_text_prefixes

from conftest import make_scenario, run_checked, stream_of
from policy_fakes import fleet_of, req

BLOCK_CHARS = 64  # 16 tokens at 4 characters a token


def test_text_blocks_are_chained_and_full_blocks_only():
    doc = "".join(chr(97 + k % 26) for k in range(10 * BLOCK_CHARS))
    a = text_block_ids(doc + "What is the first point?")
    b = text_block_ids(doc + "Summarise the second part, please, in one line.")
    assert len(a) == 10 and a == b  # the questions are under a block: not hashed, as vLLM hashes full blocks
    c = text_block_ids(doc[:3 * BLOCK_CHARS] + "X" + doc[3 * BLOCK_CHARS + 1:])
    assert c[:3] == a[:3] and not set(c[3:]) & set(a)  # one changed character: that block and all after differ
    shifted = text_block_ids(doc[BLOCK_CHARS:])
    assert not set(shifted) & set(a)  # equal text at another position is another prefix
    assert text_block_ids(None) == text_block_ids("") == []
    assert text_block_ids(doc, block_tokens=16, chars_per_token=2.0)[:1] != a[:1]  # blocks of 32 characters


def test_a_stream_with_texts_and_no_hashes_gets_ids_from_its_texts_only_then():
    texts = ["x" * 200, None, "x" * 130]
    s = stream_of([0.0, 1.0, 2.0], [50, 10, 33], [5, 5, 5], texts=texts)
    assert with_text_prefixes(s)
    assert [len(h) for h in s.hash_ids] == [3, 0, 2] and s.hash_ids[0][:2] == s.hash_ids[2]
    assert s.hash_block_size == 16 and any("characters per token" in n for n in s.stats.notes)
    hashed = stream_of([0.0], [50], [5], [[7, 8]], texts=["y" * 200])
    assert not with_text_prefixes(hashed) and hashed.hash_ids == [[7, 8]]
    bare = stream_of([0.0], [50], [5])
    assert not with_text_prefixes(bare) and bare.hash_ids is None


def test_with_an_empty_index_the_smallest_cache_tie_goes_to_the_least_loaded():
    fleet = fleet_of({"id": "a", "inflight": 9}, {"id": "b", "inflight": 2}, {"id": "c", "inflight": 5},
                     index=ApproxPrefixIndex())
    r = CacheAware(seed=3)
    assert {r.choose(req(k, prompt=100), fleet) for k in range(50)} == {"b"}  # was a random pick among all


def doc_stream(n=160, docs=8, doc_chars=40 * BLOCK_CHARS, gap_s=0.05, seed=0):
    """Requests over `docs` shared documents given as text (no hash ids), each with a unique question."""
    rng = np.random.default_rng(seed)
    bodies = ["".join(chr(97 + x) for x in rng.integers(0, 26, doc_chars)) for _ in range(docs)]
    doc = rng.integers(0, docs, n)
    texts = [bodies[d] + f" Question {i}: " + "q" * 300 for i, d in enumerate(doc)]
    prompts = [len(t) // 4 for t in texts]
    return stream_of(np.arange(n) * gap_s, prompts, [16] * n, texts=texts), doc


def hit_rate(res):
    return res.log.cached_tokens.sum() / res.log.prompt_tokens.sum()


def test_same_text_prefix_goes_to_the_same_instance_and_hits_more_than_random():
    base = {"cluster.num_instances": 4, "router.scrape_interval_s": 0.1}
    stream, doc = doc_stream()
    assert stream.hash_ids is None
    res = run_checked(make_scenario(**base, **{"router.name": "cache-aware"}), stream)
    inst = res.log.instance
    # after a document's first request, the rest of it follows to where it went (no imbalance at this load)
    assert all(len(set(inst[doc == d][1:].tolist()) | {inst[doc == d][0]}) == 1 for d in np.unique(doc))
    ca = hit_rate(res)
    stream2, _ = doc_stream()
    rnd = hit_rate(run_checked(make_scenario(**base, **{"router.name": "random"}), stream2))
    assert ca > rnd + 0.1, (ca, rnd)
    assert len(set(inst.tolist())) > 1  # the documents still spread over the fleet


def test_the_live_proxy_hashes_the_text_when_it_has_no_token_ids():
    pytest.importorskip("aiohttp")
    from test_live_proxy import Recorder, fakes, proxy, run

    class PrefixRR(Recorder):
        prefix_index = "approximate"

    doc = "abcdefghijklmnop" * 2  # 32 characters: 2 blocks of 4 tokens at 4 characters a token

    async def main():
        ws = await fakes()
        rec = PrefixRR()
        async with proxy(ws, rec, tokenizer={"mode": "estimate"}) as (ctl, url, c):
            assert ctl.tokenizer.mode == "estimate"
            for p in (doc + "one", doc + "two", doc[:16] + "Z" * 16):
                async with c.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 1}) as r:
                    assert r.status == 200
        for w in ws:
            await w.stop()
        return rec

    rec = run(main())
    assert rec.seen_prefix == [{}, {"w0": 2}, {"w0": 1, "w1": 1}]
