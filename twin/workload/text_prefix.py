"""Prefix ids from prompt text, where a request carries its text but no prefix hashes.

SGLang's cache-aware router keeps the prompt text itself in a radix tree per worker
(sgl-project/sglang `sgl-router/src/policies/cache_aware.rs`: "The tree stores raw text characters instead of
token IDs"). The twin's prefix indexes match chained block hashes (`RequestView.prefix`), so text becomes
chained ids of fixed-size character blocks: equal leading text, equal leading ids, as equal leading tokens give
vLLM equal block hashes (`vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`). The same chain the ShareGPT
and Arena readers build (`twin.workload.formats.sharegpt`), so a trace's ids and a live request's agree.

ASSUMPTION `chars_per_token` (4, as the readers' and the live proxy's estimate): a block of `block_tokens`
tokens is `block_tokens x chars_per_token` characters. Text is matched at block granularity (SGLang matches
characters), and a partial last block is not hashed, as vLLM hashes full blocks only.
"""

from __future__ import annotations

from twin.workload.formats.common import stable_id

HASH_BLOCK = 16  # tokens a text block stands for: vLLM's default block size, the readers' HASH_BLOCK


def text_block_ids(text: str | None, block_tokens: int = HASH_BLOCK, chars_per_token: float = 4.0) -> list[int]:
    """Chained ids of the full character blocks of `text` (each id names its block and every block before it)."""
    if not text:
        return []
    if block_tokens <= 0 or chars_per_token <= 0:
        raise ValueError("block_tokens and chars_per_token must be > 0")
    block = max(1, int(round(block_tokens * chars_per_token)))
    out: list[int] = []
    h = 0
    for b in range(len(text) // block):
        h = stable_id(h, text[b * block:(b + 1) * block])
        out.append(h)
    return out


def with_text_prefixes(stream, chars_per_token: float = 4.0) -> bool:
    """Give a stream with prompt texts but no `hash_ids` ids from its texts (in place); True when it did.

    The simulated engine then caches shared text prefixes as vLLM caches their shared tokens, and routers see
    them in `RequestView.prefix` by the same path as a trace's hashes. A stream with neither stays as it is.
    """
    if stream.hash_ids is not None or stream.texts is None:
        return False
    stream.hash_ids = [text_block_ids(t, HASH_BLOCK, chars_per_token) for t in stream.texts]
    stream.hash_block_size = HASH_BLOCK
    stream.hashes_cover_output = False
    stream._key_runs = None
    stream.stats.notes.append(f"prefix ids from the prompt texts: blocks of {HASH_BLOCK} tokens at an ESTIMATED "
                              f"{chars_per_token:g} characters per token (the trace has no prefix hashes)")
    return True
