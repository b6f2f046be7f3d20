"""What a worker counts as taken in: only its own model's requests (streams matches the count
against its releases for that model)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from gpu_consumers.refill_window import RefillWindow
from gpu_consumers.work_fetch import IDLE_WAIT_S, SETTLING_WAIT_S, WorkFetch
from gpu_consumers.worker import GpuWorker
from schemas import codec
from tests.streams.test_streams_gate import request


class Message:
    def __init__(self, record: dict, offset: int, released_at_ms: int | None = None, partition: int = 0):
        self._value, self._headers = codec.encode("InferenceRequested", record)
        self._offset = offset
        self._partition = partition
        self._released_at_ms = int(time.time() * 1000) if released_at_ms is None else released_at_ms

    def timestamp(self):
        return 1, self._released_at_ms  # (TIMESTAMP_CREATE_TIME, ms), as confluent_kafka gives it

    def value(self):
        return self._value

    def headers(self):
        return self._headers

    def partition(self):
        return self._partition

    def offset(self):
        return self._offset

    def topic(self):
        return "work"

    def key(self):
        return None

    def error(self):
        return None


@pytest.mark.kafka
def test_other_models_records_are_skipped_and_not_counted_as_taken_in(kafka_bootstrap):
    engine = SimpleNamespace(max_num_seqs=4)
    worker = GpuWorker(engine, "mine", worker_id="intake-test")
    try:
        theirs = dict(request("a"), model="theirs")
        mine = dict(request("a"), model="mine")
        worker.intake.take(Message(theirs, 0))
        worker.intake.take(Message(theirs, 1))
        assert worker.intake.consumed_total == 0 and worker.book.pending == []
        worker.intake.take(Message(mine, 2))
        assert worker.intake.consumed_total == 1
        assert [r["request_id"] for _, r in worker.book.pending] == [mine["request_id"]]
    finally:
        worker.partitions.close()
        worker.readers.close()


class ScriptedConsumer:
    """Hands out the given batches one consume() call at a time and records how it was asked."""

    def __init__(self, batches: list[list[str]]):
        self.batches = list(batches)
        self.calls: list[tuple[int, float]] = []

    def consume(self, num_messages: int, timeout: float) -> list[str]:
        self.calls.append((num_messages, timeout))
        return self.batches.pop(0)[:num_messages] if self.batches else []


def intake_worker(consumer, ended: int, max_wait_s: float = 0.05, producer=None, commit=None) -> WorkFetch:
    fetch = WorkFetch(SimpleNamespace(consumer=consumer), producer, commit or (lambda: None),
                      RefillWindow(max_wait_s))  # the fetch alone: no engine, no Kafka clients
    fetch.stepped(ended, 1.0)
    return fetch


def test_after_a_step_that_ended_requests_the_worker_waits_for_that_many_then_takes_the_rest_at_once():
    consumer = ScriptedConsumer([["a"], ["b"], ["c", "d"]])
    got = intake_worker(consumer, ended=2).take(room=8, busy=True, pending=0)
    assert got == ["a", "b", "c", "d"]
    (n1, t1), (n2, t2), (n3, t3) = consumer.calls
    assert (n1, n2) == (2, 1) and 0 < t1 <= 0.05 and 0 < t2 <= 0.05  # waited for the two successors
    assert (n3, t3) == (6, 0)  # and then did not wait for more


def test_a_busy_worker_that_ended_nothing_does_not_wait_before_its_next_step():
    consumer = ScriptedConsumer([["a"]])
    assert intake_worker(consumer, ended=0).take(room=8, busy=True, pending=0) == ["a"]
    assert consumer.calls == [(8, 0)]


def test_the_window_ends_at_its_deadline_when_the_successors_do_not_come():
    consumer = ScriptedConsumer([])
    worker = intake_worker(consumer, ended=3, max_wait_s=0.01)
    assert worker.take(room=8, busy=True, pending=0) == []
    assert all(t <= 0.01 for _, t in consumer.calls) and consumer.calls[-1] == (8, 0)
    assert worker.refill_window.hit_rate < 1.0  # the miss is remembered


class UndeliveredProducer:
    """A producer holding `undelivered` events until a poll serves their delivery reports."""

    def __init__(self, undelivered: int, on_report):
        self.undelivered, self.on_report, self.polls = undelivered, on_report, []

    def __len__(self) -> int:
        return self.undelivered

    def poll(self, timeout: float = 0) -> int:
        self.polls.append(timeout)
        served, self.undelivered = self.undelivered, 0
        for _ in range(served):
            self.on_report()
        return served


def idle_worker(consumer, undelivered: int) -> tuple[WorkFetch, list[str]]:
    happened: list[str] = []
    producer = UndeliveredProducer(undelivered, lambda: happened.append("delivery report"))
    return intake_worker(consumer, ended=0, producer=producer, commit=lambda: happened.append("commit")), happened


def test_an_idle_worker_whose_last_events_await_delivery_commits_on_their_report_before_waiting_for_work():
    consumer = ScriptedConsumer([["a"]])
    worker, happened = idle_worker(consumer, undelivered=2)
    assert worker.take(room=8, busy=False, pending=0) == ["a"]
    assert worker.producer.polls == [SETTLING_WAIT_S]
    assert happened == ["delivery report", "delivery report", "commit"]  # the commit follows the reports at once
    assert consumer.calls == [(8, 0)]  # and the work that came meanwhile is taken without waiting


def test_an_idle_worker_with_nothing_outstanding_waits_for_work_a_long_turn():
    consumer = ScriptedConsumer([])
    worker, happened = idle_worker(consumer, undelivered=0)
    assert worker.take(room=8, busy=False, pending=0) == []
    assert worker.producer.polls == [] and happened == []
    (n, first_wait) = consumer.calls[0]
    assert n == 1 and IDLE_WAIT_S - 0.01 < first_wait <= IDLE_WAIT_S  # the rest of the turn, fetch by fetch


def test_an_idle_worker_whose_request_waits_on_its_grammar_comes_round_quickly():
    consumer = ScriptedConsumer([])
    worker, _ = idle_worker(consumer, undelivered=1)
    worker.take(room=8, busy=False, pending=1)
    assert worker.producer.polls == []  # the grammar's request is what the loop comes round for
    assert all(t <= 0.02 for _, t in consumer.calls)
