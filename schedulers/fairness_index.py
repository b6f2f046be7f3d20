"""How fair the service actually was: measures over per-tenant service in a window.

* Jain's index, ``(sum x)^2 / (n * sum x^2)`` over the tenants' weighted service: 1.0
  when every tenant got the same, ``1/n`` when one tenant got everything.
* The VTC paper's maximum service difference: the largest gap in weighted service
  between two tenants that were both backlogged (Sheng et al., OSDI 2024, where the
  fair scheduler bounds it by a constant).

Service is weighted tokens divided by the tenant's fairness weight, the same units as
the fair queue's virtual counters.
"""
from __future__ import annotations

from collections import deque


def jain_index(values: list[float]) -> float | None:
    """None for no tenants or no service at all."""
    total = sum(values)
    squares = sum(v * v for v in values)
    if not values or squares == 0:
        return None
    return total * total / (len(values) * squares)


def max_service_difference(service: dict[str, float], backlogged: set[str]) -> float | None:
    """Largest service gap between two backlogged tenants (None with fewer than two)."""
    values = [service.get(t, 0.0) for t in backlogged]
    if len(values) < 2:
        return None
    return max(values) - min(values)


class ServiceWindow:
    """Weighted service per tenant over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, str, float]] = deque()
        self._totals: dict[str, float] = {}

    def add(self, tenant_id: str, service: float, now: float) -> None:
        if service > 0:
            self._events.append((now, tenant_id, service))
            self._totals[tenant_id] = self._totals.get(tenant_id, 0.0) + service
        self._expire(now)

    def totals(self, now: float) -> dict[str, float]:
        self._expire(now)
        return {t: v for t, v in self._totals.items() if v > 1e-9}

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._events and self._events[0][0] < horizon:
            _, tenant_id, service = self._events.popleft()
            left = self._totals.get(tenant_id, 0.0) - service
            if left > 1e-9:
                self._totals[tenant_id] = left
            else:  # float rounding can leave a crumb; the tenant's last event took it all
                self._totals.pop(tenant_id, None)
