"""topic_reader.read_to_end reads exactly what a topic held when it was called, on a real broker."""
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader

pytestmark = pytest.mark.kafka


def _topic(kafka_bootstrap, partitions: int = 2, **config) -> str:
    name = f"reader-test-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1, config=config)])[name].result(15)
    return name


def _produce(topic: str, values: list[tuple[int, str]], timestamp_ms: int | None = None) -> None:
    producer = Producer(kafka_clients.producer_config("reader-test"))
    for partition, value in values:
        producer.produce(topic, value=value.encode(), key=value.encode(), partition=partition,
                         **({"timestamp": timestamp_ms} if timestamp_ms else {}))
    assert producer.flush(15) == 0


def _values(msgs) -> list[str]:
    return sorted(m.value().decode() for m in msgs)


def test_reads_every_partition_to_where_it_ended_at_the_call_and_no_further(kafka_bootstrap):
    topic = _topic(kafka_bootstrap)
    _produce(topic, [(0, "a"), (0, "b"), (1, "c")])
    reader = topic_reader.read_to_end(topic_reader.whole_topic(topic), "test")
    first = next(reader)  # the ends are fixed by now
    _produce(topic, [(0, "late"), (1, "later")])
    assert _values([first, *reader]) == ["a", "b", "c"]
    assert topic_reader.end_offsets(topic) == {0: 3, 1: 2}


def test_starts_at_given_offsets_and_skips_partitions_already_read(kafka_bootstrap):
    topic = _topic(kafka_bootstrap)
    _produce(topic, [(0, "a"), (0, "b"), (0, "c"), (1, "d")])
    read = list(topic_reader.read_to_end({(topic, 0): 1, (topic, 1): 1}, "test"))
    assert _values(read) == ["b", "c"]
    assert [m.offset() for m in read] == [1, 2]
    assert list(topic_reader.read_to_end({(topic, 0): 3}, "test")) == []


def test_since_starts_each_partition_at_its_first_record_that_recent(kafka_bootstrap):
    topic = _topic(kafka_bootstrap)
    now = int(time.time() * 1000)
    _produce(topic, [(0, "old"), (1, "old too")], timestamp_ms=now - 3_600_000)
    _produce(topic, [(0, "new")], timestamp_ms=now)
    read = topic_reader.read_to_end(topic_reader.whole_topic(topic), "test", since_ms=now - 60_000)
    assert _values(read) == ["new"]


def test_a_read_that_cannot_reach_the_end_in_time_raises(kafka_bootstrap):
    topic = _topic(kafka_bootstrap, partitions=1)
    _produce(topic, [(0, "a")])
    # An end beyond what exists stands for a broker that never delivers the rest.
    with pytest.raises(TimeoutError, match="could not read to the end"):
        list(topic_reader.read_to_end({(topic, 0): OFFSET_BEGINNING}, "test", timeout=1.0, ends={(topic, 0): 5},
                                      **{"enable.partition.eof": False}))
