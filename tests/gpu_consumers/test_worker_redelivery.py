"""A `work` record delivered again while its request runs (a consumer that re-read from the committed
offset, or a partition that came back) must not move the commit past that request: if the worker then
dies, the request has to be delivered again, not lost."""
from __future__ import annotations

import time
from types import SimpleNamespace

from confluent_kafka import TopicPartition

from gpu_consumers.recorded_usage import RecordedUsage
from gpu_consumers.work_partitions import WorkPartitions
from tests.gpu_consumers.test_worker_intake import Message
from tests.gpu_consumers.worker_parts import parts_without_kafka
from tests.streams.test_streams_gate import request


class RecordingEngine:
    def __init__(self):
        self.added: list[str] = []

    def can_admit(self, tokens: int) -> bool:
        return True

    def add_request(self, request_id, prompt_token_ids, params, **kwargs):
        self.added.append(request_id)


def test_a_record_delivered_again_while_its_request_runs_keeps_the_commit_below_it():
    record = dict(request("a"), deadline_ms=int((time.time() + 60) * 1000))
    parts = parts_without_kafka(record["model"], RecordingEngine())
    parts.intake.take(Message(record, 5))
    parts.intake.start_pending()
    assert parts.engine.added == [record["request_id"]]
    assert parts.offsets.committable()[0][0] == 5

    parts.intake.take(Message(record, 5))  # the same record again, while the request runs
    parts.intake.start_pending()
    assert parts.engine.added == [record["request_id"]], "the request must not run twice"
    assert parts.offsets.committable()[0][0] == 5, "the commit moved past a request that is still running"

    parts.offsets.done(0, 5)  # it ends: now the commit may pass it
    assert parts.offsets.committable()[0][0] == 6


def test_a_second_release_of_a_running_request_is_done_at_once():
    # the same request in `work` twice (two offsets): the second copy is a duplicate, not work to wait for
    record = dict(request("a"), deadline_ms=int((time.time() + 60) * 1000))
    parts = parts_without_kafka(record["model"], RecordingEngine())
    parts.intake.take(Message(record, 5))
    parts.intake.take(Message(record, 6))
    parts.intake.start_pending()
    assert parts.engine.added == [record["request_id"]]
    parts.offsets.done(0, 5)
    assert parts.offsets.committable()[0][0] == 7


class SlowCoordinatorConsumer:
    """A `work` client whose first committed-offsets read times out, as a loaded coordinator's does."""

    def __init__(self, failures: int):
        self.failures, self.assigned = failures, None

    def committed(self, partitions, timeout):
        from confluent_kafka import KafkaException

        if self.failures:
            self.failures -= 1
            raise KafkaException("KafkaError{code=_TIMED_OUT}")
        return [TopicPartition(p.topic, p.partition, 7, metadata="9") for p in partitions]

    def incremental_assign(self, partitions):
        self.assigned = [(p.partition, p.offset) for p in partitions]

    def assignment(self):
        return []


def test_an_assignment_whose_committed_offsets_time_out_once_still_starts_at_them():
    # Left to librdkafka a partition that came back resumed past a dead worker's request (issue 36), so a
    # first timeout must be retried, not end in librdkafka's placement.
    parts = parts_without_kafka("tiny", RecordingEngine())
    partitions = WorkPartitions.__new__(WorkPartitions)  # the rebalance callbacks alone: no `work` client
    assigned: list[bool] = []
    partitions.offsets, partitions.recorded_usage = parts.offsets, RecordedUsage(read=lambda since_ms: set())
    partitions.on_assigned = lambda: assigned.append(True)
    consumer = SlowCoordinatorConsumer(failures=1)
    partitions.on_assign(consumer, [TopicPartition("work", 3)])
    assert consumer.assigned == [(3, 7)]
    assert parts.offsets.already_done(3, 9) and not parts.offsets.already_done(3, 8)
    assert partitions.assigned and partitions.numbers == {3} and assigned == [True]


class RecordingProducer:
    """Takes events as a producer would and reports each delivered at once."""

    def __init__(self):
        self.topics: list[str] = []

    def produce(self, topic, on_delivery=None, **kwargs):
        self.topics.append(topic)
        if on_delivery is not None:
            on_delivery(None, None)


def test_a_redelivered_request_its_previous_owner_recorded_replies_again_but_is_not_recorded_twice():
    # Worker b finished the request and its RequestCompleted was delivered, but b was SIGKILLed before its
    # commit landed: this worker, the partition's next owner, is handed the request again.
    now_ms = int(time.time() * 1000)
    recorded, fresh = (dict(request(t), deadline_ms=now_ms - 1) for t in ("a", "b"))
    reads = []
    usage = RecordedUsage(read=lambda since_ms: reads.append(since_ms) or {recorded["request_id"]})
    parts = parts_without_kafka(recorded["model"], RecordingEngine(), RecordingProducer(), recorded_usage=usage)
    usage.assigned([0])
    parts.intake.take(Message(recorded, 5, released_at_ms=now_ms - 60_000))
    parts.intake.take(Message(fresh, 6, released_at_ms=now_ms - 59_000))
    parts.intake.start_pending()  # both past their deadlines: each ends unstarted, with its 503 and its usage
    assert len(reads) == 1
    assert parts.producer.topics.count("usage") == 1, "the recorded request got a second RequestCompleted"
    assert parts.producer.topics.count(recorded["reply_topic"]) == 2  # both clients still get their answer
    assert parts.offsets.committable()[0][0] == 7  # and both offsets are done
