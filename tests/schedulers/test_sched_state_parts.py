"""The queue's and the ledger's state given piecewise (what streams writes as one table entry per
thing that changes) is the same as the parts of their whole ``to_dict``."""
from __future__ import annotations

from schedulers import FairQueue, QueuedRequest, QuotaLedger

NOW = 1_800_000_000.0


def queue_with_work() -> FairQueue:
    queue = FairQueue()
    for i, tenant in enumerate("aabb"):
        queue.enqueue(QueuedRequest(f"r{i}", tenant, "interactive", 8, 8, NOW, deadline=NOW + 60))
    queue.pop_next(NOW)
    return queue


def ledger_with_work() -> QuotaLedger:
    ledger = QuotaLedger()
    ledger.reserve("a", "r1", 10, NOW)
    ledger.reserve("b", "r2", 5, NOW)
    ledger.settle("r1", 7, NOW + 1)
    return ledger


def test_the_queues_pieces_are_the_parts_of_its_whole_state():
    queue = queue_with_work()
    whole = queue.to_dict()
    assert queue.globals_state() == {k: whole[k] for k in ("floor", "next_seq", "counters")}
    assert [{**r.to_dict(), "seq": queue.seq_of(r.request_id)} for r in queue.queued()] == whole["requests"]


def test_the_ledgers_pieces_are_the_parts_of_its_whole_state():
    ledger = ledger_with_work()
    whole = ledger.to_dict()
    assert {t: ledger.tenant_state(t) for t in ledger.tenants()} == whole["usage"]
    assert [ledger.reservation_state("r2")] == whole["reservations"]
    assert ledger.reservation_state("r1") is None and ledger.tenant_state("nobody") is None
    assert ledger.is_open("r2") and not ledger.is_open("r1")
