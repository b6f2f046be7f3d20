"""OwnerTransaction commits each record once, through aborts and stuck clients, and stops for good once
another owner holds the transactional id (a fake client and coordinator stand in for librdkafka's)."""
from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from streams.owner_transaction import Fenced, OwnerTransaction


class Coordinator:
    """The broker's view of one transactional id: the current epoch and what was committed."""

    def __init__(self):
        self.epoch = 0
        self.committed: list[bytes] = []
        self.outcomes: list[str] = []  # what the next commits do: "abortable", "timeout"; then they succeed
        self.clients: list["FakeClient"] = []
        self.busy_inits = 0  # how many init_transactions calls answer CONCURRENT_TRANSACTIONS first


class FakeClient:
    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator
        self.epoch = None
        self.open: list[bytes] | None = None
        self.purged = False
        coordinator.clients.append(self)

    def init_transactions(self, timeout):
        if self.coordinator.busy_inits:
            self.coordinator.busy_inits -= 1
            raise KafkaException(KafkaError(KafkaError.CONCURRENT_TRANSACTIONS, "still ending the last one",
                                            retriable=True))
        self.coordinator.epoch += 1  # fences every older holder
        self.epoch = self.coordinator.epoch

    def _check_epoch(self):
        if self.epoch != self.coordinator.epoch:
            raise KafkaException(KafkaError(KafkaError._FENCED, "fenced by a newer epoch", fatal=True))

    def begin_transaction(self):
        self._check_epoch()
        self.open = []

    def produce(self, topic, key=None, value=None, headers=None, partition=None, on_delivery=None):
        self._check_epoch()
        self.open.append(value)

    def commit_transaction(self, timeout):
        self._check_epoch()
        outcome = self.coordinator.outcomes.pop(0) if self.coordinator.outcomes else "ok"
        if outcome == "abortable":
            raise KafkaException(KafkaError(KafkaError._STATE, "abort me", txn_requires_abort=True))
        if outcome == "timeout":
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no answer", retriable=True))
        self.coordinator.committed.extend(self.open)
        self.open = None

    def abort_transaction(self, timeout):
        self.open = None

    def purge(self, in_queue=True, in_flight=True):
        self.purged = True

    def poll(self, timeout=0):
        return 0

    def list_topics(self, timeout=None):
        return None

    def flush(self, timeout=None):
        return 0


def owner(coordinator: Coordinator, stall_after_s: float = 3.0) -> OwnerTransaction:
    return OwnerTransaction({}, "gate-owner", client_factory=lambda config: FakeClient(coordinator),
                            stall_after_s=stall_after_s)


def test_each_record_is_committed_once_in_order():
    c = Coordinator()
    tx = owner(c)
    for value in (b"a", b"b"):
        tx.produce("work", value=value)
    assert tx.commit(5)
    tx.produce("work", value=b"c")
    assert tx.commit(5)
    assert c.committed == [b"a", b"b", b"c"]
    assert tx.commit(5)  # nothing open: nothing to do


def test_an_aborted_transaction_is_sent_again_whole():
    c = Coordinator()
    tx = owner(c)
    tx.produce("work", value=b"a")
    tx.produce("state", value=b"s")
    c.outcomes = ["abortable"]
    assert tx.commit(5)
    assert c.committed == [b"a", b"s"]


def test_a_stuck_commit_gets_a_new_client_and_the_records_are_sent_once():
    c = Coordinator()
    tx = owner(c, stall_after_s=0.0)
    tx.produce("work", value=b"a")
    c.outcomes = ["timeout"]
    assert tx.commit(5)
    assert len(c.clients) == 2 and c.clients[0].purged
    assert c.committed == [b"a"]


def test_a_new_client_the_coordinator_is_not_ready_for_is_tried_again():
    # As after a broker restart: the stuck client is given up, and the coordinator is still ending
    # its transaction when the new one asks for the id.
    c = Coordinator()
    tx = owner(c, stall_after_s=0.0)
    tx.produce("work", value=b"a")
    c.outcomes = ["timeout"]
    c.busy_inits = 2
    assert tx.commit(10)
    assert c.committed == [b"a"] and c.busy_inits == 0


def test_a_commit_that_runs_out_of_time_keeps_its_records_for_the_next():
    c = Coordinator()
    tx = owner(c, stall_after_s=60.0)
    tx.produce("work", value=b"a")
    c.outcomes = ["timeout"] * 3
    assert not tx.commit(0.0)
    assert c.committed == [] and len(tx) == 1
    tx.produce("work", value=b"b")
    c.outcomes = []
    assert tx.commit(5)
    assert c.committed == [b"a", b"b"]


def test_an_owner_whose_id_was_taken_over_commits_nothing_more():
    c = Coordinator()
    stalled = owner(c)
    stalled.produce("work", value=b"decided before the stall")
    successor = owner(c)  # takes the transactional id over while the first one sleeps
    successor.produce("work", value=b"released by the successor")
    assert successor.commit(5)
    with pytest.raises(Fenced):
        stalled.commit(5)
    with pytest.raises(Fenced):
        stalled.produce("work", value=b"decided after waking")
    assert c.committed == [b"released by the successor"]
