"""Fixed-size pool of KV-cache blocks: free list, ref counts, prefix-cache hash map.

Block 0 is reserved as a "null" block: it is never handed out, so padded entries
of block tables can point at it safely.

Free blocks live in one ordered queue.  Blocks that hold no cached prefix are kept
at the front (they are reused first); free blocks that still hold a cached full
block are appended at the back in the order they were freed, so eviction of
cached blocks is least-recently-freed first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(1, num_blocks)
        )
        self.num_evictions = 0
        # Bumped whenever the set of cached hashes changes, so a worker can tell the gate only when it did.
        self.cache_version = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, including cached-but-free)."""
        return len(self.free_queue)

    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def get_cached_block(self, block_hash: bytes) -> int | None:
        return self.hash_to_block.get(block_hash)

    # -------------------------------------------------------------- mutations
    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"out of KV blocks: want {n}, have {len(self.free_queue)}")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                # evict the cached prefix held by this block
                self.block_hash[b] = None
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                self.num_evictions += 1
                self.cache_version += 1
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on (possibly free but cached) blocks."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def free(self, blocks) -> None:
        """Drop one reference on each block, in the given order."""
        for b in blocks:
            rc = self.ref_cnt[b] - 1
            if rc < 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_cnt[b] = rc
            if rc == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def cache_block(self, block: int, block_hash: bytes) -> None:
        """Register a full, computed block under its chain hash."""
        if self.block_hash[block] is not None:
            return
        if block_hash in self.hash_to_block:
            return  # identical content already cached in another block
        self.block_hash[block] = block_hash
        self.hash_to_block[block_hash] = block
        self.cache_version += 1

    def reset_prefix_cache(self) -> None:
        for b in list(self.hash_to_block.values()):
            self.block_hash[b] = None
        self.hash_to_block.clear()
        self.cache_version += 1

    def check_invariants(self) -> None:
        """Debug/test helper: consistency of free queue, ref counts and hash map."""
        assert NULL_BLOCK not in self.free_queue
        for b in range(1, self.num_blocks):
            in_free = b in self.free_queue
            assert (self.ref_cnt[b] == 0) == in_free, (b, self.ref_cnt[b], in_free)
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h
