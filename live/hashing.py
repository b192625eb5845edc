"""Prefix block hashes over token ids, chained in the worker's block size: equal prefixes, equal hashes.

One hash for both prefix indexes. The approximate index is fed these at dispatch. The precise index is fed
vLLM's KV events, whose block hashes are vLLM's own (`vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`:
sha256 of the parent hash, the block's token ids and extra keys, seeded by `init_none_hash`, which draws a
random seed per process unless PYTHONHASHSEED is set). Rather than re-implement that (it changes across
versions and needs each worker's seed), the subscriber maps each vLLM hash to this chain from the
`token_ids` the events carry (`live.kv_subscriber.HashTranslator`); so it works for workers it did not start.
The chaining itself is the twin's (`twin.workload.prefix_hash`): Python's tuple hash of ints is not
randomised per process, so these values are stable across runs.
Not modelled: LoRA ids, multimodal extra keys and `cache_salt`, which make vLLM's hashes differ for equal
tokens; this chain treats such blocks as equal.
"""

from __future__ import annotations

from typing import Sequence

from twin.workload import prefix_hash

ROOT_HASH = prefix_hash.LIVE_ROOT  # the parent of a prompt's first block


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The chain's key of one block of token ids (twin.workload.prefix_hash, the twin's own chaining)."""
    return prefix_hash.block_hash(parent, tuple(tokens))


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of the full blocks of `token_ids` (a partial last block is not cached by vLLM, so not hashed)."""
    return prefix_hash.token_block_hashes(token_ids, block_size, parent)
