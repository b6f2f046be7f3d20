"""A request finished and recorded by a worker killed before its commit landed runs again under the
partition's next owner, without a second RequestCompleted (gpu_consumers/recorded_usage.py)."""
from __future__ import annotations

import time

import pytest

from gpu_consumers.recorded_usage import CLOCK_MARGIN_MS, RecordedUsage, completions_since

ASSIGNED_AT = 1_000_000


class Usage:
    """`usage` as the reads see it: the ids recorded, and every `since` asked for."""

    def __init__(self, recorded: set[str], fail: bool = False):
        self.recorded, self.fail, self.reads = recorded, fail, []

    def __call__(self, since_ms: int) -> set[str]:
        self.reads.append(since_ms)
        if self.fail:
            raise TimeoutError("could not read to the end of [('usage', 3)] within 30 s")
        return set(self.recorded)


def assigned(usage: Usage, *partitions: int) -> RecordedUsage:
    recorded = RecordedUsage(read=usage, clock_ms=lambda: ASSIGNED_AT)
    recorded.assigned(partitions)
    return recorded


def test_a_record_released_before_the_assignment_reads_usage_from_before_its_release_once():
    usage = Usage({"done-before"})
    recorded = assigned(usage, 0)
    recorded.taken(0, ASSIGNED_AT - 20_000)
    recorded.taken(0, ASSIGNED_AT - 19_000)  # later records of the partition: the read covered them
    assert usage.reads == [ASSIGNED_AT - 20_000 - CLOCK_MARGIN_MS]
    assert recorded.already_recorded("done-before")
    assert not recorded.already_recorded("done-before"), "reported once: its run here then ends it"
    assert not recorded.already_recorded("never-recorded")


def test_records_released_after_the_assignment_read_nothing():
    usage = Usage({"x"})
    recorded = assigned(usage, 0)
    recorded.taken(0, ASSIGNED_AT + CLOCK_MARGIN_MS + 1)
    recorded.taken(0, ASSIGNED_AT - 50_000)  # only the first record after an assignment is looked at
    assert usage.reads == [] and not recorded.already_recorded("x")


def test_a_second_partition_reads_again_only_for_an_older_release():
    usage = Usage({"x"})
    recorded = assigned(usage, 0, 1, 2)
    recorded.taken(0, ASSIGNED_AT - 10_000)
    recorded.taken(1, ASSIGNED_AT - 5_000)  # within what the first read covered
    recorded.taken(2, ASSIGNED_AT - 30_000)  # before it: read again from there
    assert usage.reads == [ASSIGNED_AT - 10_000 - CLOCK_MARGIN_MS, ASSIGNED_AT - 30_000 - CLOCK_MARGIN_MS]


def test_a_partition_given_up_before_its_first_record_reads_nothing():
    usage = Usage({"x"})
    recorded = assigned(usage, 0)
    recorded.forget(0)
    recorded.taken(0, ASSIGNED_AT - 10_000)
    assert usage.reads == []


def test_a_failed_read_leaves_the_request_to_be_recorded():
    usage = Usage({"x"}, fail=True)
    recorded = assigned(usage, 0)
    recorded.taken(0, ASSIGNED_AT - 10_000)
    assert usage.reads and not recorded.already_recorded("x")


def test_a_record_without_a_create_time_reads_nothing_rather_than_all_of_usage():
    usage = Usage({"x"})
    recorded = assigned(usage, 0)
    recorded.taken(0, -1)  # confluent-kafka's TIMESTAMP_NOT_AVAILABLE
    assert usage.reads == [] and not recorded.already_recorded("x")


@pytest.mark.kafka
def test_completions_since_reads_what_usage_recorded_since_then_and_passes_over_other_records(kafka_bootstrap):
    import uuid

    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    from infra.kafka import clients as kafka_clients
    from schemas import codec
    from tests.billing.billing_events import completed

    topic = f"usage-test-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})  # kept: a collected client ends its futures
    admin.create_topics([NewTopic(topic, 3, 1)])[topic].result(15)
    producer = Producer(kafka_clients.producer_config("recorded-usage-test"))
    now = int(time.time() * 1000)
    for request_id, stamp in (("an-hour-ago", now - 3_600_000), ("just-now", now), ("also-now", now)):
        value, headers = codec.encode("RequestCompleted", completed(request_id, f"tenant-{request_id}"))
        producer.produce(topic, key=request_id.encode(), value=value, headers=headers, timestamp=stamp)
    producer.produce(topic, key=b"junk", value=b"not an event", timestamp=now)  # passed over, not fatal
    assert producer.flush(15) == 0
    assert completions_since(now - 60_000, topic) == {"just-now", "also-now"}
