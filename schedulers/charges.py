"""What a tenant's counter was charged at each release, kept until the request's usage settles it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator


@dataclass(frozen=True)
class Charge:
    """What a tenant's counter was charged when its request was released.

    It travels with the work (put it in the work message) and comes back to
    :meth:`FairQueue.on_usage`, which needs both the estimate and the weight used, so
    the correction is exact even if the tenant's weight changed meanwhile.
    """

    request_id: str
    tenant_id: str
    weighted_tokens: float
    weight: float
    released_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "weighted_tokens": self.weighted_tokens,
            "weight": self.weight,
            "released_at": self.released_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Charge:
        return cls(**data)


class UnsettledCharges:
    """The charges of released requests whose usage has not come back yet, and how many each tenant
    has (its released requests still running). The count is kept with the charges: every release
    consults it, and recounting the charges there cost O(requests in flight) per release."""

    def __init__(self) -> None:
        self.by_request: dict[str, Charge] = {}
        self.running: dict[str, int] = {}  # tenant id -> unsettled charges
        self._checked_at: float | None = None

    def __iter__(self) -> Iterator[Charge]:
        return iter(self.by_request.values())

    def get(self, request_id: str) -> Charge | None:
        return self.by_request.get(request_id)

    def add(self, charge: Charge) -> None:
        self.drop(charge.request_id)  # a request released again replaces its charge
        self.by_request[charge.request_id] = charge
        self.running[charge.tenant_id] = self.running.get(charge.tenant_id, 0) + 1

    def drop(self, request_id: str) -> Charge | None:
        charge = self.by_request.pop(request_id, None)
        if charge is not None:
            left = self.running[charge.tenant_id] - 1
            if left:
                self.running[charge.tenant_id] = left
            else:
                del self.running[charge.tenant_id]
        return charge

    def forget_stale(self, now: float, ttl_s: float) -> None:
        """Charges whose usage never arrived in ``ttl_s`` (a lost event) stop counting."""
        # A charge only goes stale after ttl_s, so looking a few times per TTL is enough, and
        # cheaper than walking every request in flight on each shedding pass.
        if self._checked_at is not None and now - self._checked_at < ttl_s / 16:
            return
        self._checked_at = now
        horizon = now - ttl_s
        for request_id in [r for r, c in self.by_request.items() if c.released_at < horizon]:
            self.drop(request_id)
