"""Allocates KV blocks to sequences; prefix caching via a hash chain of full blocks.

Block i of a sequence is identified by hash(hash(block i-1), token ids of block i,
cache_salt).  The salt (per tenant) is part of every hash, so sequences with
different salts never share cached blocks.
"""

from __future__ import annotations

# the gate places by the same salts (formats/prefix_hash.py): one definition of both
from formats.prefix_hash import adapter_cache_salt, hash_block  # noqa: F401

from .block_pool import BlockPool
from .sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens found in the cache

    # ---------------------------------------------------------------- helpers
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks()

    def block_hashes_for(self, seq: Sequence, start_block: int, end_block: int) -> list[bytes]:
        """The prefix-cache hashes of the sequence's full blocks [start_block, end_block)."""
        self._ensure_hashes(seq, end_block * self.block_size)
        return seq.block_hashes[start_block:end_block]

    def _ensure_hashes(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        toks = seq.token_ids
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else b""
            hashes.append(hash_block(parent, toks[i * bs:(i + 1) * bs], seq.cache_salt))

    # ------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Longest run of cached full blocks at the start of seq (never all of it:
        at least one token is always left to compute so there are logits)."""
        if not self.enable_prefix_caching:
            return []
        max_tokens = seq.num_tokens - 1
        self._ensure_hashes(seq, max_tokens)
        blocks = []
        get = self.pool.get_cached_block
        for h in seq.block_hashes[: max_tokens // self.block_size]:
            b = get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def cached_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` hashes of blocks in the prefix cache, the most recently cached last."""
        hashes = self.pool.hash_to_block
        if len(hashes) <= limit:
            return list(hashes)
        return list(hashes)[-limit:]

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer newly completed full blocks of seq to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        nfull = seq.num_computed_tokens // self.block_size
        if nfull <= seq.num_registered_blocks:
            return
        self._ensure_hashes(seq, nfull * self.block_size)
        for i in range(seq.num_registered_blocks, nfull):
            self.pool.cache_block(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered_blocks = nfull

    # -------------------------------------------------------------- allocation
    def _num_blocks_to_take(self, seq: Sequence, num_new_tokens: int, computed_blocks) -> int:
        ncomp = len(computed_blocks)
        total = seq.num_computed_tokens + ncomp * self.block_size + num_new_tokens
        need_new = max(self.num_blocks_for(total) - len(seq.block_table) - ncomp, 0)
        if ncomp:
            ref = self.pool.ref_cnt
            # cached blocks that are currently free leave the free queue when touched
            need_new += sum(1 for b in computed_blocks if ref[b] == 0)
        return need_new

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks=()) -> bool:
        return self._num_blocks_to_take(seq, num_new_tokens, computed_blocks) <= self.pool.num_free_blocks()

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks=()) -> bool:
        """Make room for num_new_tokens more tokens after seq's computed tokens
        (and after computed_blocks, prefix-cache hits that get appended first).
        Returns False, changing nothing, if there are not enough free blocks."""
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        ncomp = len(computed_blocks)
        total = seq.num_computed_tokens + ncomp * self.block_size + num_new_tokens
        need_new = self.num_blocks_for(total) - len(seq.block_table) - ncomp
        if ncomp:
            self.pool.touch(computed_blocks)
            seq.block_table.extend(computed_blocks)
            seq.num_registered_blocks = len(seq.block_table)
            seq.num_computed_tokens += ncomp * self.block_size
        if need_new > 0:
            seq.block_table.extend(self.pool.allocate(need_new))
        return True

    def fork(self, child: Sequence, parent: Sequence) -> tuple[int, int, int] | None:
        """Let an n>1 sibling share its parent's prompt KV (all prompt tokens but the
        last, which the child recomputes to get its own first-token logits).
        Full blocks are shared by ref count; a partial block is copied.
        Returns (src_block, dst_block, num_slots) for the KV copy, None if no copy is
        needed; raises if there is no free block (caller checks can_fork)."""
        bs = self.block_size
        k = child.num_tokens - 1
        nfull, rem = divmod(k, bs)
        shared = parent.block_table[:nfull]
        self.pool.touch(shared)
        child.block_table = list(shared)
        child.block_hashes = list(parent.block_hashes[:nfull])
        child.num_registered_blocks = min(parent.num_registered_blocks, nfull)
        child.block_table.extend(self.pool.allocate(1))
        child.num_computed_tokens = k
        if rem:
            return parent.block_table[nfull], child.block_table[nfull], rem
        return None

    def can_fork(self, child: Sequence, parent: Sequence) -> bool:
        return (bool(parent.block_table) and parent.num_computed_tokens >= child.num_tokens - 1
                and self.pool.num_free_blocks() >= 1)

    def free(self, seq: Sequence) -> None:
        # reverse order: tail blocks of a sequence get evicted before its head blocks
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_registered_blocks = 0

    def usage(self) -> float:
        used = self.pool.num_usable_blocks - self.pool.num_free_blocks()
        return used / self.pool.num_usable_blocks
