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

The ledger and the queue give their state piecewise (``tenant_state``, ``reservation_state``,
``seq_of``, ``globals_state``) for the entries, and the functions below rebuild them from
the entries through their own ``from_dict``.
"""
from __future__ import annotations

from typing import Any

from schedulers import FairQueue, FairQueueConfig, QuotaConfig, QuotaLedger

REQ, ENDED, EARLY_CANCEL, IN_WORK, TENANT = "r/", "e/", "x/", "w/", "t/"
FQ, CREDITS, POS, WORKPOS = "fq", "credits", "pos", "workpos"


def restore_ledger(usage: dict[str, dict[str, Any]], reservations: list[dict[str, Any]],
                   ended: dict[str, float], config: QuotaConfig) -> QuotaLedger:
    """The quota ledger of the ``t/`` entries (usage), the reservations of the ``r/`` entries and the
    ``e/`` entries (ended ids, which it refuses to admit again)."""
    data = {"version": 1, "limits": {}, "usage": usage, "reservations": reservations,
            "ended": [[r, t] for r, t in sorted(ended.items(), key=lambda e: e[1])]}
    return QuotaLedger.from_dict(data, config)


def restore_queue(globals_state: dict[str, Any] | None, queued: list[dict[str, Any]],
                  charges: list[dict[str, Any]], config: FairQueueConfig) -> FairQueue:
    """The fair queue of the ``fq`` entry, the queued requests and the charges of the ``r/`` entries."""
    g = globals_state or {"floor": 0.0, "next_seq": 0, "counters": {}}
    next_seq = max([int(g["next_seq"])] + [int(q["seq"]) + 1 for q in queued])
    data = {"version": 1, "next_seq": next_seq, "floor": g["floor"], "counters": g["counters"],
            "requests": queued, "unsettled": charges}
    return FairQueue.from_dict(data, config)
