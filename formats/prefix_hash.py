"""The prefix-cache block hash, shared by the engine (which caches by it) and the gate (which places by it).

Block i of a prompt is named by hash(name of block i-1, token ids of block i, cache salt): a chain, so a
block's name stands for the whole prefix up to and including it. The salt (the tenant id, unless the tenant
shares its cache) is part of every link, so two tenants' identical prompts never share a name.

Workers tell the gate which blocks they hold by the leading ``SUMMARY_KEY_BYTES`` bytes of each name. At 8
bytes and a few thousand blocks per worker, a wrong match (two prefixes sharing a key) has odds of about
1 in 10^15 per lookup; its only effect would be a worse placement.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

SUMMARY_KEY_BYTES = 8


def hash_block(parent: bytes, token_ids, cache_salt: str | None) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if cache_salt is not None:
        h.update(b"\x00salt\x00")
        h.update(cache_salt.encode("utf-8"))
    return h.digest()


def adapter_cache_salt(cache_salt: str | None, adapter_id: str) -> str:
    """The salt of a sequence that runs with a LoRA adapter: its request's salt and the adapter id, so
    that a cached prefix of one adapter is never a hit for another adapter nor for the base model
    (tenant ids and adapter ids hold no NUL, so no base salt can equal one of these)."""
    return f"{cache_salt or ''}\x00lora\x00{adapter_id}"


def cacheable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks the engine can take from its cache (it always computes the last token itself)."""
    return max(0, num_prompt_tokens - 1) // block_size


def summary_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> Iterator[bytes]:
    """The summary keys of a prompt's cacheable blocks, first block first, computed as they are asked for
    (a caller that stops at the first block nobody holds hashes no further)."""
    parent = b""
    for i in range(cacheable_blocks(len(token_ids), block_size)):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], cache_salt)
        yield parent[:SUMMARY_KEY_BYTES]


def pack_keys(keys) -> bytes:
    return b"".join(keys)


def unpack_keys(packed: bytes) -> set[bytes]:
    n = SUMMARY_KEY_BYTES
    return {packed[i:i + n] for i in range(0, len(packed) - len(packed) % n, n)}
