"""Which offset of each `work` partition is safe to commit.

Requests from one partition finish out of order, so the committable position is
the oldest offset still in flight: a crash then redelivers exactly the unfinished
ones (and some finished ones, which billing de-duplicates by request id).
"""
from __future__ import annotations


class OffsetTracker:
    def __init__(self):
        self._pending: dict[int, set[int]] = {}
        self._next: dict[int, int] = {}
        self._committed: dict[int, int] = {}

    def started(self, partition: int, offset: int) -> None:
        self._pending.setdefault(partition, set()).add(offset)
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def done(self, partition: int, offset: int) -> None:
        self._pending.get(partition, set()).discard(offset)

    def forget(self, partition: int) -> None:
        self._pending.pop(partition, None)
        self._next.pop(partition, None)
        self._committed.pop(partition, None)

    def committable(self) -> dict[int, int]:
        """Partitions whose commit position moved since the last call, with the new position."""
        moved = {}
        for partition, next_offset in self._next.items():
            pending = self._pending.get(partition)
            position = min(pending) if pending else next_offset
            if self._committed.get(partition) != position:
                moved[partition] = position
        return moved

    def mark_committed(self, positions: dict[int, int]) -> None:
        self._committed.update(positions)
