"""One tenant's place in the fair queue: its queued requests, a FIFO per declared class."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from schedulers.deadline import DeadlinePolicy
from schedulers.priority import AgingPolicy, PriorityClass
from schedulers.queue_records import QueuedRequest


@dataclass
class QueueEntry:
    request: QueuedRequest
    seq: int  # global enqueue order; gives FIFO and deterministic tie-breaks


class TenantBacklog:
    """One tenant's queued requests, one FIFO per declared class.

    Plain dicts keep insertion order, which is enqueue order, and give O(1) removal
    by id for cancellations.
    """

    def __init__(self) -> None:
        self.by_class: dict[PriorityClass, dict[str, QueueEntry]] = {p: {} for p in PriorityClass}
        self.queued_tokens = 0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, entry: QueueEntry) -> None:
        self.by_class[entry.request.priority][entry.request.request_id] = entry
        self.queued_tokens += entry.request.cost_tokens
        self.count += 1

    def discard(self, request: QueuedRequest) -> None:
        del self.by_class[request.priority][request.request_id]
        self.queued_tokens -= request.cost_tokens
        self.count -= 1

    def entries(self) -> Iterator[QueueEntry]:
        for q in self.by_class.values():
            yield from q.values()

    def tier_heads(self, aging: AgingPolicy, now: float) -> list[tuple[PriorityClass, QueueEntry]]:
        """The tenant's live head in each tier (an aged batch head competes as interactive)."""
        interactive = _first_live(self.by_class[PriorityClass.INTERACTIVE], now)
        batch = _first_live(self.by_class[PriorityClass.BATCH], now)
        heads: list[tuple[PriorityClass, QueueEntry]] = []
        if batch is not None and aging.is_aged(batch.request.enqueued_at, now):
            # The aged batch head joins the interactive tier; FIFO inside the tenant
            # decides between it and the tenant's own interactive head. The rest of
            # the batch FIFO waits behind it, so there is no batch-tier head.
            if interactive is None or batch.seq < interactive.seq:
                interactive = batch
            batch = None
        if interactive is not None:
            heads.append((PriorityClass.INTERACTIVE, interactive))
        if batch is not None:
            heads.append((PriorityClass.BATCH, batch))
        return heads


def _first_live(fifo: dict[str, QueueEntry], now: float) -> QueueEntry | None:
    for entry in fifo.values():
        if not DeadlinePolicy.is_expired(entry.request.deadline, now):
            return entry
    return None
