"""Prefix block hashes over token ids, chained in the worker's block size: equal prefixes, equal hashes.

One hash for both prefix indexes. The approximate index is fed these at dispatch. The precise index is fed
vLLM's KV events, whose block hashes are vLLM's own (`vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`:
sha256 of the parent hash, the block's token ids and extra keys, seeded by `init_none_hash`, which draws a
random seed per process unless PYTHONHASHSEED is set). Rather than re-implement that (it changes across
versions and needs each worker's seed), the subscriber maps each vLLM hash to this chain from the
`token_ids` the events carry (`live.kv_subscriber.HashTranslator`); so it works for workers it did not start.
Python's tuple hash of ints is not randomised per process, so these values are stable across runs.
Not modelled: LoRA ids, multimodal extra keys and `cache_salt`, which make vLLM's hashes differ for equal
tokens; this chain treats such blocks as equal.
"""

from __future__ import annotations

from typing import Sequence

ROOT_HASH = 0x6C6C6D74  # the parent of a prompt's first block


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of the full blocks of `token_ids` (a partial last block is not cached by vLLM, so not hashed)."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    out: list[int] = []
    h = parent
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[i:i + block_size])))
        out.append(h)
    return out
