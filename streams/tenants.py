"""What streams needs to know of each tenant, from the compacted `tenants` topic.

Only the scheduling-relevant part of a TenantSnapshot is kept: quota limits, the
fair-share weight and the queue cap. A tenant streams has not heard of yet (its
snapshot is still on the way) gets the schema's defaults, the same numbers a freshly
created tenant has.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from schedulers import TenantLimits
from schemas import codec
from schemas.records import TenantSnapshot


def _positive(value):
    return value if value and value > 0 else None


@dataclass(frozen=True)
class TenantSettings:
    limits: TenantLimits
    fairness_weight: float
    max_queued: int
    disabled: bool = False

    @classmethod
    def from_snapshot(cls, snap: TenantSnapshot) -> TenantSettings:
        limits = TenantLimits(
            requests_per_minute=_positive(snap["requests_per_minute"]),
            tokens_per_minute=_positive(snap["tokens_per_minute"]),
            max_concurrent=_positive(snap["max_concurrent"]),
            monthly_token_budget=_positive(snap["monthly_token_budget"]),
        )
        weight = float(snap["fairness_weight"])
        return cls(limits, weight if weight > 0 else 1.0, max(0, int(snap["max_queued"])), bool(snap["disabled"]))


@lru_cache(maxsize=1)
def default_settings() -> TenantSettings:
    record = codec.new_event("TenantSnapshot", tenant_id="-")
    defaults = codec.decode(*codec.encode("TenantSnapshot", record))
    return TenantSettings.from_snapshot(codec.record_of(defaults, TenantSnapshot))


class TenantBook:
    def __init__(self) -> None:
        self._settings: dict[str, TenantSettings] = {}

    def apply(self, tenant_id: str, snapshot: TenantSnapshot | None) -> TenantSettings | None:
        if snapshot is None:
            self._settings.pop(tenant_id, None)
            return None
        settings = TenantSettings.from_snapshot(snapshot)
        self._settings[tenant_id] = settings
        return settings

    def get(self, tenant_id: str) -> TenantSettings:
        return self._settings.get(tenant_id) or default_settings()

    def known(self) -> list[str]:
        return list(self._settings)
