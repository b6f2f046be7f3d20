"""What a worker tells the gate about its prefix cache, so the gate can place requests where their prefix is.

Each summary is the whole set (not a change list): the summary key (formats/prefix_hash.py) of every
block in the prefix cache, at most ``MAX_BLOCKS`` of them (the most recently cached), 8 bytes each: 32 KiB
at most. A whole set is idempotent, so a lost or stale advert, or a new gate owner that never saw the
earlier ones, is put right by the next summary; a change list would need ordering and a resync protocol for
a saving that does not matter at these sizes. A summary rides on the capacity advert:

* when the cache changed, at most every ``MIN_INTERVAL_S`` (prefills cache blocks every step; the gate
  needs the picture within a few hundred ms, not every 20 ms);
* and at least every ``REFRESH_S`` even if nothing changed, for a gate owner that just took over.

Adverts in between carry none (null): the gate keeps the last one it has.
"""
from __future__ import annotations

from formats.prefix_hash import SUMMARY_KEY_BYTES, pack_keys

MAX_BLOCKS = 4096
MIN_INTERVAL_S = 0.2
REFRESH_S = 2.0


class PrefixSummary:
    def __init__(self, engine) -> None:
        self.engine = engine
        self._sent_version: int | None = None
        self._sent_at = float("-inf")

    def due(self, now: float) -> bool:
        """True when the next advert should carry a summary."""
        if now - self._sent_at >= REFRESH_S:
            return True
        return self.engine.prefix_cache_version != self._sent_version and now - self._sent_at >= MIN_INTERVAL_S

    def take(self, now: float) -> bytes | None:
        """The packed summary if one is due, else None."""
        if not self.due(now):
            return None
        self._sent_version = self.engine.prefix_cache_version
        self._sent_at = now
        return pack_keys(h[:SUMMARY_KEY_BYTES] for h in self.engine.cached_block_hashes(MAX_BLOCKS))

    def resend(self) -> None:
        """Send the whole summary with the next advert (a new partition assignment: a new gate may listen)."""
        self._sent_at = float("-inf")
