"""How much of a process's lookups one tenant may hold at once: concurrent replays (`GET
/v1/responses/{id}?stream=true` and `POST /v1/responses` with background and stream, each holding a
reply consumer until the response ends or its deadline) and concurrent lookups (a stored response's GET,
DELETE, cancel or input items, which wait for the view to settle and may read reply events back).

Each is capped per tenant and per process; past either cap the call is refused at once with a 429
(`too_many_replays` / `too_many_lookups`, Retry-After 1), never queued: a tenant holding its own replays
waits on its own, and the rest of the process stays for everyone else. Request quota (a read counts one
request against requests-per-minute) is EdgeAdmission.meter's."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from http_api.openai_errors import APIError
from infra import settings


class Held:
    """One taken slot; `release` gives it back (once, whatever calls it)."""

    def __init__(self, slots: TenantSlots, tenant_id: str):
        self._slots, self.tenant_id = slots, tenant_id
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._slots._give_back(self.tenant_id)

    def release_later(self) -> None:
        """`release` from any thread (a finalizer): done by the event loop at the next `take`."""
        self._slots._later.append(self)

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class TenantSlots:
    """At most `per_tenant` held per tenant and `total` per process. Used from the event loop only (no
    lock: a finalizer that released under one could fire inside `take` on the same thread, and deadlock);
    a release from elsewhere goes through `Held.release_later`."""

    def __init__(self, what: str, code: str, per_tenant: int, total: int):
        self.what, self.code, self.per_tenant, self.total = what, code, per_tenant, total
        self._held: dict[str, int] = {}
        self._count = 0
        self._later: deque[Held] = deque()

    def _drain(self) -> None:
        while self._later:
            self._later.popleft().release()

    def take(self, tenant_id: str) -> Held:
        self._drain()
        mine = self._held.get(tenant_id, 0)
        if mine >= self.per_tenant:
            raise APIError(429, f"Too many concurrent {self.what} for this API key (at most {self.per_tenant}); "
                                "wait for one to end.", code=self.code, headers={"Retry-After": "1"})
        if self._count >= self.total:
            raise APIError(429, f"This server holds its most concurrent {self.what} ({self.total}); try again "
                                "shortly.", code=self.code, headers={"Retry-After": "1"})
        self._held[tenant_id] = mine + 1
        self._count += 1
        return Held(self, tenant_id)

    def _give_back(self, tenant_id: str) -> None:
        left = self._held.get(tenant_id, 0) - 1
        if left > 0:
            self._held[tenant_id] = left
        else:
            self._held.pop(tenant_id, None)
        self._count -= 1

    def held(self, tenant_id: str) -> int:
        self._drain()
        return self._held.get(tenant_id, 0)


@dataclass
class ReadLimits:
    replays: TenantSlots
    lookups: TenantSlots

    @classmethod
    def from_env(cls) -> ReadLimits:
        return cls(
            replays=TenantSlots("replayed response streams", "too_many_replays",
                                settings.REPLAYS_PER_TENANT.get(), settings.REPLAYS_TOTAL.get()),
            lookups=TenantSlots("response lookups", "too_many_lookups",
                                settings.LOOKUPS_PER_TENANT.get(), settings.LOOKUPS_TOTAL.get()))
