"""The queue and the ledger rebuilt from streams' table entries make the same decisions: their
restored whole state is the state the entries were taken from."""
from __future__ import annotations

from streams.durable_state import restore_ledger, restore_queue
from tests.schedulers.test_sched_state_parts import NOW, ledger_with_work, queue_with_work


def test_a_queue_restored_from_its_entries_is_the_same_queue():
    queue = queue_with_work()
    whole = queue.to_dict()
    restored = restore_queue(queue.globals_state(), whole["requests"], whole["unsettled"], queue.config)
    assert restored.to_dict() == whole


def test_a_ledger_restored_from_its_entries_is_the_same_ledger():
    ledger = ledger_with_work()
    whole = ledger.to_dict()
    restored = restore_ledger(whole["usage"], whole["reservations"], {"r1": NOW + 1}, ledger.config)
    assert restored.to_dict() == whole
