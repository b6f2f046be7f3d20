"""The Virtual Token Counters of the fair queue: per tenant, the weighted service it was given
divided by its weight (see fair_queue.py), and the lift that stops idle time banking credit."""
from __future__ import annotations

import heapq
from typing import Mapping


class VirtualCounters:
    def __init__(self, backlogged: Mapping[str, object]) -> None:
        self.by_tenant: dict[str, float] = {}
        # Counter of the last tenant to leave when the whole queue drained: the lift
        # target for a tenant arriving at an empty queue (VTC keeps this so a tenant
        # cannot gain by arriving while nobody else is queued).
        self.floor = 0.0
        # The queue's backlogged tenants (its own dict, read, never changed here).
        self._backlogged = backlogged
        # A lazy min-heap of (counter, backlogged tenant), so the least counter is found without
        # scanning every tenant; an entry is stale once that tenant's counter changed or it left,
        # skipped when it surfaces, and the heap is rebuilt when stale entries outnumber live ones.
        self._waiting: list[tuple[float, str]] = []

    def of(self, tenant_id: str) -> float:
        return self.by_tenant.get(tenant_id, 0.0)

    def add(self, tenant_id: str, amount: float) -> None:
        """Charge (or, negative, refund) the tenant; call ``note_waiting`` if it is backlogged."""
        self.by_tenant[tenant_id] = self.by_tenant.get(tenant_id, 0.0) + amount

    def note_waiting(self, tenant_id: str) -> None:
        """Record a backlogged tenant's (new) counter for the least-counter lookup."""
        heapq.heappush(self._waiting, (self.by_tenant.get(tenant_id, 0.0), tenant_id))
        if len(self._waiting) > 4 * len(self._backlogged) + 64:
            self._waiting = [(self.by_tenant.get(t, 0.0), t) for t in self._backlogged]
            heapq.heapify(self._waiting)

    def least_waiting(self) -> float | None:
        heap = self._waiting
        while heap:
            counter, tenant_id = heap[0]
            if tenant_id in self._backlogged and self.by_tenant.get(tenant_id, 0.0) == counter:
                return counter
            heapq.heappop(heap)
        return None

    def lift(self, tenant_id: str) -> None:
        """No banking of idle credit: an arriving tenant starts no lower than the
        least-served tenant that is currently waiting."""
        least = self.least_waiting()
        target = self.floor if least is None else least
        self.by_tenant[tenant_id] = max(self.by_tenant.get(tenant_id, 0.0), target)

    def drained_by(self, tenant_id: str) -> None:
        """The tenant was the last to leave the queue: its counter is the floor from now on."""
        self.floor = max(self.floor, self.by_tenant.get(tenant_id, 0.0))
