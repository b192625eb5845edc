"""One prefix chaining (twin.workload.prefix_hash) behind the engine's trace keys, the parity harness and the
live proxy, with the very values each wrote by hand before: a change here would move every cached-prefix key."""

import pytest

from live import hashing as live
from twin.engine.request import KeyBases, _chain
from twin.lab.parity import block_keys
from twin.workload.prefix_hash import LIVE_ROOT, TRACE_ROOT, block_hash, chain, token_block_hashes

IDS = [7, 7, 123456789, -3, 2 ** 40]
TOKENS = list(range(100, 137))  # 37 tokens: two full blocks of 16 and a partial one


def by_hand(parent, contents):
    """The loop the three copies had: h = hash((h, content)) from the root."""
    out, h = [], parent
    for c in contents:
        h = hash((h, c))
        out.append(h)
    return out


def test_the_engines_trace_chain_is_the_shared_one():
    assert chain(IDS) == _chain(IDS) == by_hand(0x5EED, IDS)
    assert TRACE_ROOT == 0x5EED
    # a fresh KeyBases gives a first path its chained ids as bases: one run starting at the first block's id
    assert KeyBases().runs_of(IDS) == [(chain(IDS)[0], 0, len(IDS))]


def test_parity_block_keys_are_the_shared_token_chain():
    want = by_hand(0x5EED, [tuple(TOKENS[0:16]), tuple(TOKENS[16:32])])
    assert block_keys(TOKENS, 16) == token_block_hashes(TOKENS, 16) == want
    assert block_keys(TOKENS[:15], 16) == []


def test_live_chain_is_the_shared_token_chain_from_its_own_root():
    want = by_hand(0x6C6C6D74, [tuple(TOKENS[0:8]), tuple(TOKENS[8:16]), tuple(TOKENS[16:24]),
                                tuple(TOKENS[24:32])])
    assert live.ROOT_HASH == LIVE_ROOT == 0x6C6C6D74
    assert live.chain_hashes(TOKENS, 8) == token_block_hashes(TOKENS, 8, LIVE_ROOT) == want
    assert live.block_hash(LIVE_ROOT, TOKENS[:8]) == block_hash(LIVE_ROOT, tuple(TOKENS[:8])) == want[0]


def test_a_different_first_block_changes_every_later_key():
    other = [1] + TOKENS[1:]
    a, b = token_block_hashes(TOKENS, 16), token_block_hashes(other, 16)
    assert a[0] != b[0] and a[1] != b[1]
    with pytest.raises(ValueError, match="block_size must be > 0"):
        token_block_hashes(TOKENS, 0)
