"""The ledger writer's batch path without ClickHouse or a broker: rows into an in-memory sink, the
checkpoint only after the sink took them and the dead letters are delivered, and commits offered
again when the broker refuses them."""
from __future__ import annotations

import threading
import uuid

import pytest
from confluent_kafka import KafkaException, TopicPartition

from billing_events import completed
from billing_pipeline.ledger import LEDGER_COLUMNS
from billing_pipeline.ledger_checkpoint import LedgerCheckpoint
from billing_pipeline.ledger_flush import LedgerFlush
from billing_pipeline.ledger_sink import InMemoryLedgerSink
from billing_pipeline.pricing import PriceBook
from billing_pipeline.writer_stats import WriterStats
from schemas import codec, topics

PRICES = PriceBook({("*", "input"): ([0], [3]), ("*", "cached_input"): ([0], [1]), ("*", "output"): ([0], [7])})


class UsageMessage:
    def __init__(self, value: bytes, headers: list, offset: int, partition: int = 0):
        self.value_, self.headers_, self.offset_, self.partition_ = value, headers, offset, partition

    @classmethod
    def of(cls, record: dict, offset: int, partition: int = 0) -> "UsageMessage":
        return cls(*codec.encode("RequestCompleted", record), offset, partition)

    def value(self):
        return self.value_

    def headers(self):
        return self.headers_

    def key(self):
        return b"tenant"

    def topic(self):
        return topics.USAGE.name

    def partition(self):
        return self.partition_

    def offset(self):
        return self.offset_


class DeadLetterProducer:
    """Holds dead letters; flush() says how many are undelivered (`undelivered_flushes` times first)."""

    def __init__(self, undelivered_flushes: int = 0):
        self.dead: list[str] = []
        self.undelivered_flushes = undelivered_flushes

    def produce(self, topic, **kwargs):
        self.dead.append(topic)

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        if self.undelivered_flushes:
            self.undelivered_flushes -= 1
            return len(self.dead)
        return 0


def flush_into(sink, producer=None, stopped=None):
    checkpoints: list[list] = []
    flush = LedgerFlush(sink, lambda: PRICES, lambda: producer or DeadLetterProducer(), "flush-test",
                        WriterStats(), stopped or threading.Event(), checkpoints.append)
    return flush, checkpoints


def events(n: int, tenant: str = "acme") -> list[UsageMessage]:
    return [UsageMessage.of(completed(f"{tenant}-{uuid.uuid4().hex[:6]}-{i}", tenant, prompt=10, completion=5), i)
            for i in range(n)]


def test_a_batch_is_written_then_checkpointed_and_priced():
    sink = InMemoryLedgerSink()
    flush, checkpoints = flush_into(sink)
    batch = events(3)
    assert flush.write(batch) == 3
    assert len(sink.rows) == 3 and checkpoints == [batch]
    cost = LEDGER_COLUMNS.index("cost_pusd")
    assert all(row[cost] == 10 * 3 + 5 * 7 for row in sink.rows.values())
    assert flush.stats.inserted == 3 and flush.stats.batches == 1


def test_a_batch_written_twice_is_one_row_per_request():
    sink = InMemoryLedgerSink()
    flush, _ = flush_into(sink)
    batch = events(4)
    flush.write(batch)
    flush.write(batch)  # redelivered after a crash before the checkpoint landed
    assert len(sink.rows) == 4 and len(sink.writes) == 2


def test_the_checkpoint_waits_until_the_sink_takes_the_batch(monkeypatch):
    monkeypatch.setattr("billing_pipeline.ledger_flush.FIRST_RETRY_S", 0.0)
    sink = InMemoryLedgerSink(fail_next=2)
    flush, checkpoints = flush_into(sink)
    flush.write(events(2))
    assert flush.stats.insert_errors == 2 and len(sink.rows) == 2 and len(checkpoints) == 1


def test_a_stopping_writer_whose_sink_fails_checkpoints_nothing():
    stopped = threading.Event()
    stopped.set()
    flush, checkpoints = flush_into(InMemoryLedgerSink(fail_next=1), stopped=stopped)
    with pytest.raises(ConnectionError):
        flush.write(events(2))
    assert checkpoints == []


def test_undecodable_and_unbillable_messages_are_dead_lettered_and_the_batch_goes_on():
    producer = DeadLetterProducer()
    sink = InMemoryLedgerSink()
    flush, checkpoints = flush_into(sink, producer)
    good = events(2)
    garbage = UsageMessage(b"\x00garbage", [("tm-event", b"RequestCompleted"), ("tm-schema-version", b"1")], 2)
    unbillable = UsageMessage.of(completed("acme-bad", "acme", prompt=5, cached=9), 3)
    assert flush.write([*good, garbage, unbillable]) == 2
    assert producer.dead == [topics.DEAD_LETTERS.name] * 2 and flush.stats.dead_lettered == 2
    assert len(checkpoints) == 1 and len(checkpoints[0]) == 4  # their offsets are passed too


def test_a_stopping_writer_with_undelivered_dead_letters_checkpoints_nothing():
    stopped = threading.Event()
    stopped.set()
    garbage = UsageMessage(b"\x00garbage", [("tm-event", b"RequestCompleted"), ("tm-schema-version", b"1")], 0)
    flush, checkpoints = flush_into(InMemoryLedgerSink(), DeadLetterProducer(undelivered_flushes=1), stopped)
    with pytest.raises(RuntimeError):
        flush.write([garbage])
    assert checkpoints == []


class CommitRecorder:
    def __init__(self, refuse: bool = False, positions: list | None = None):
        self.commits: list[list[tuple[int, int]]] = []
        self.refuse, self.positions = refuse, positions or []

    def commit(self, *, offsets, asynchronous):
        assert asynchronous  # a synchronous commit can hang on a lost coordinator
        if self.refuse:
            raise KafkaException("KafkaError{code=_UNKNOWN_PARTITION}")
        self.commits.append([(tp.partition, tp.offset) for tp in offsets])

    def assignment(self):
        return [TopicPartition(topics.USAGE.name, p) for p, _ in self.positions]

    def position(self, partitions):
        return [TopicPartition(topics.USAGE.name, p, o) for p, o in self.positions]


def test_the_checkpoint_commits_past_each_partitions_last_message():
    consumer = CommitRecorder()
    checkpoint = LedgerCheckpoint(lambda: consumer, WriterStats())
    checkpoint.commit_batch([*events(3), UsageMessage.of(completed("x", "acme"), 7, partition=2)])
    assert sorted(consumer.commits[0]) == [(0, 3), (2, 8)]


def test_an_idle_writer_commits_past_a_transaction_marker_once_and_again_after_a_refused_answer():
    consumer = CommitRecorder(positions=[(0, 5)])
    stats = WriterStats()
    checkpoint = LedgerCheckpoint(lambda: consumer, stats)
    checkpoint.commit_past_markers()
    checkpoint.commit_past_markers()
    assert consumer.commits == [[(0, 5)]]  # taken as committed until an answer says otherwise
    refused = TopicPartition(topics.USAGE.name, 0, 5)
    checkpoint.on_commit(KafkaException("coordinator gone"), [refused])
    checkpoint.commit_past_markers()
    assert consumer.commits == [[(0, 5)], [(0, 5)]] and stats.commits == 0
    checkpoint.on_commit(None, [refused])
    assert stats.commits == 1


def test_a_refused_commit_leaves_the_batch_to_be_read_again():
    checkpoint = LedgerCheckpoint(lambda: CommitRecorder(refuse=True), WriterStats())
    checkpoint.commit_batch(events(1))
    assert checkpoint.positions == {}
