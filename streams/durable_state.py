"""The scheduler's state as table entries: what is written, and how it is read back.

The queue and the quota ledger are pure objects from schedulers/ that can be saved
whole (``to_dict``). Saving them whole after every event would rewrite the whole
queue each time, so streams keeps one table entry per thing that changes
independently, and rebuilds the whole objects from the entries on takeover:

========================  ======================================================
key                       value (JSON)
========================  ======================================================
``r/<request id>``        an admitted request that has not ended: ``queued`` (its
                          record, queue entry and reservation) or ``released``
                          (its VTC charge and reservation)
``e/<request id>``        when the request ended (dedupe of redeliveries; swept
                          after ``ended_ttl_s``)
``x/<request id>``        a cancellation that arrived before its request
``w/<request id>``        found in `work` on takeover, not yet seen on `requests`
``t/<tenant id>``         the tenant's quota counters (window, month, in flight)
``fq``                    fair-queue counters (VTC per tenant, floor, next seq)
``credits``               worker adverts and the in-transit list
``pos``                   next offset of every input partition
``workpos``               per `work` partition, the offset after the last release
                          known delivered (takeover scans `work` from here)
========================  ======================================================

The helpers below reach into the ledger's and queue's internals through subclasses,
so schedulers/ keeps its small public surface.
"""
from __future__ import annotations

from typing import Any

from schedulers import Charge, FairQueue, FairQueueConfig, QuotaConfig, QuotaLedger

REQ, ENDED, EARLY_CANCEL, IN_WORK, TENANT = "r/", "e/", "x/", "w/", "t/"
FQ, CREDITS, POS, WORKPOS = "fq", "credits", "pos", "workpos"


class DurableLedger(QuotaLedger):
    # Both records are flat (numbers and strings), so a copy of their fields is what asdict would
    # give, at a fraction of its cost (it ran for every request, twice).
    def tenant_state(self, tenant_id: str) -> dict[str, Any] | None:
        usage = self._usage.get(tenant_id)
        return dict(vars(usage)) if usage is not None else None

    def reservation_state(self, request_id: str) -> dict[str, Any] | None:
        res = self._reservations.get(request_id)
        return dict(vars(res)) if res is not None else None

    def is_open(self, request_id: str) -> bool:
        return request_id in self._reservations

    def tenants(self) -> list[str]:
        return list(self._usage)

    @classmethod
    def restore(cls, usage: dict[str, dict], reservations: list[dict], ended: dict[str, float],
                config: QuotaConfig) -> DurableLedger:
        data = {"version": 1, "limits": {}, "usage": usage, "reservations": reservations,
                "ended": sorted(([r, t] for r, t in ended.items()), key=lambda e: e[1])}
        return cls.from_dict(data, config)  # the policy's own restore, building this subclass


class DurableQueue(FairQueue):
    def seq_of(self, request_id: str) -> int:
        tenant_id = self._where[request_id]
        for fifo in self._backlogs[tenant_id].by_class.values():
            entry = fifo.get(request_id)
            if entry is not None:
                return entry.seq
        raise KeyError(request_id)

    def globals_state(self) -> dict[str, Any]:
        return {"floor": self._floor, "next_seq": self._next_seq, "counters": dict(self._counters)}

    def forget_charge(self, request_id: str) -> None:
        self._drop_charge(request_id)

    @classmethod
    def restore(cls, globals_state: dict[str, Any] | None, queued: list[dict], charges: list[dict],
                config: FairQueueConfig) -> DurableQueue:
        g = globals_state or {"floor": 0.0, "next_seq": 0, "counters": {}}
        next_seq = max([int(g["next_seq"])] + [int(q["seq"]) + 1 for q in queued])
        data = {"version": 1, "next_seq": next_seq, "floor": g["floor"], "counters": g["counters"],
                "requests": queued, "unsettled": charges}
        return cls.from_dict(data, config)  # the policy's own restore, building this subclass


def charge_from(data: dict[str, Any]) -> Charge:
    return Charge.from_dict(data)
