"""Prefix chaining, written once for the twin, the parity harness and the live controller: a block's key hashes
its parent's key with the block's own content, so equal keys mean equal prefixes.

vLLM chains its prefix-cache block hashes the same way (`vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`:
the parent block's hash, the block's token ids and extra keys; only full blocks are hashed). The twin keys are
Python's hash of a (parent, content) tuple: ints and tuples of ints are not salted per process (PYTHONHASHSEED
salts str and bytes only), so keys are equal across runs and processes. Content is a trace's block id (Mooncake's
`hash_ids`, chained by the engine's requests) or a block's token ids as a tuple (the parity harness, live).
Not modelled: LoRA ids, multimodal extra keys and `cache_salt`, which make vLLM's hashes differ for equal tokens.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence

TRACE_ROOT = 0x5EED  # the parent of a trace's (and a parity workload's) first block
LIVE_ROOT = 0x6C6C6D74  # the parent of a live prompt's first block (live.hashing.ROOT_HASH)


def block_hash(parent: int, content: Hashable) -> int:
    """One link of the chain: the key of a block whose parent's key is `parent`."""
    return hash((parent, content))


def chain(contents: Iterable[Hashable], parent: int = TRACE_ROOT) -> list[int]:
    """Keys of consecutive blocks: element t names block t and every block before it."""
    out: list[int] = []
    h = parent
    for c in contents:
        h = hash((h, c))
        out.append(h)
    return out


def token_block_hashes(token_ids: Sequence[int], block_size: int, parent: int = TRACE_ROOT) -> list[int]:
    """Keys of the full blocks of `token_ids` (a partial last block is not cached by vLLM, so not hashed)."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    return chain((tuple(token_ids[i:i + block_size]) for i in range(0, len(token_ids) - block_size + 1, block_size)),
                 parent)


__all__ = ["LIVE_ROOT", "TRACE_ROOT", "block_hash", "chain", "token_block_hashes"]
