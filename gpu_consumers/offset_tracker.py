"""Which offset of each `work` partition is safe to commit.

Requests from one partition finish out of order, so the committable position is
the oldest offset still in flight: a crash then redelivers the unfinished ones. The
ones above that position that did finish travel in the commit's metadata, so the
worker that takes the partition over skips them instead of running them again.
"""
from __future__ import annotations

# Kafka brokers accept 4 KiB of offset metadata by default (offset.metadata.max.bytes).
MAX_METADATA_CHARS = 4000


def encode_done(done: set[int]) -> str:
    text = ",".join(str(o) for o in sorted(done))
    if len(text) > MAX_METADATA_CHARS:  # keep the lowest ones; beyond that, billing de-duplicates
        text = text[:MAX_METADATA_CHARS].rsplit(",", 1)[0]
    return text


def decode_done(metadata: str | None) -> set[int]:
    if not metadata:
        return set()
    try:
        return {int(part) for part in metadata.split(",") if part}
    except ValueError:
        return set()


class OffsetTracker:
    def __init__(self):
        self._pending: dict[int, set[int]] = {}
        self._done: dict[int, set[int]] = {}
        self._next: dict[int, int] = {}
        self._committed: dict[int, tuple[int, str]] = {}
        self._skip: dict[int, set[int]] = {}

    def adopt(self, partition: int, position: int, metadata: str | None) -> None:
        """A partition was assigned: remember which offsets past `position` already finished elsewhere."""
        self._skip[partition] = {o for o in decode_done(metadata) if o >= position}

    def already_done(self, partition: int, offset: int) -> bool:
        return offset in self._skip.get(partition, ())

    def started(self, partition: int, offset: int) -> None:
        self._pending.setdefault(partition, set()).add(offset)
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def done(self, partition: int, offset: int) -> None:
        pending = self._pending.get(partition, set())
        if offset in pending:
            pending.discard(offset)
            self._done.setdefault(partition, set()).add(offset)

    def forget(self, partition: int) -> None:
        for table in (self._pending, self._done, self._next, self._committed, self._skip):
            table.pop(partition, None)

    def committable(self) -> dict[int, tuple[int, str]]:
        """Partitions whose commit moved since the last call: (position, metadata of finished offsets above it)."""
        moved = {}
        for partition, next_offset in self._next.items():
            pending = self._pending.get(partition)
            position = min(pending) if pending else next_offset
            done = self._done.get(partition, set())
            done.difference_update({o for o in done if o < position})
            skipped = {o for o in self._skip.get(partition, ()) if o >= position}
            commit = (position, encode_done(done | skipped))
            if self._committed.get(partition) != commit:
                moved[partition] = commit
        return moved

    def mark_committed(self, positions: dict[int, tuple[int, str]]) -> None:
        self._committed.update(positions)

    def commit_failed(self, partition: int, position: tuple[int, str]) -> None:
        """A commit marked as done did not go through: offer it again (unless a newer one was made)."""
        if self._committed.get(partition) == position:
            del self._committed[partition]
