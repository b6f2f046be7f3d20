import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from schemas import codec, topics

pytestmark = pytest.mark.kafka


def test_every_declared_topic_exists_with_its_settings(kafka_bootstrap):
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    meta = admin.list_topics(timeout=10).topics
    for spec in topics.ALL_TOPICS:
        assert spec.name in meta, spec.name
        assert len(meta[spec.name].partitions) == spec.partitions
    from confluent_kafka.admin import ConfigResource
    res = ConfigResource(ConfigResource.Type.TOPIC, topics.TENANTS.name)
    cfg = admin.describe_configs([res])[res].result()
    assert cfg["cleanup.policy"].value == "compact"


def _read_at(topic: str, partition: int, offset: int):
    """The one message at topic/partition/offset (tests share topics, so read exactly there)."""
    consumer = Consumer(kafka_clients.consumer_config(None, "probe"))
    consumer.assign([TopicPartition(topic, partition, offset)])
    try:
        for _ in range(100):
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                return msg
    finally:
        consumer.close()
    return None


def _produce_and_locate(producer, topic, **kwargs):
    where = {}
    producer.produce(topic, on_delivery=lambda err, msg: where.update(p=msg.partition(), o=msg.offset()), **kwargs)
    producer.flush(10)
    return where["p"], where["o"]


def test_undecodable_message_goes_to_dead_letters(kafka_bootstrap):
    producer = Producer(kafka_clients.producer_config("t"))
    partition, offset = _produce_and_locate(
        producer, topics.REQUESTS.name, key=b"x", value=b"\x00garbage",
        headers=[("tm-event", b"InferenceRequested"), ("tm-schema-version", b"1")])
    got = _read_at(topics.REQUESTS.name, partition, offset)
    assert got is not None and got.value() == b"\x00garbage"

    assert kafka_clients.decode_or_dead_letter(producer, got, "test-consumer") is None
    producer.poll(0)
    producer.flush(10)
    # other consumers (the session's streams) may dead-letter the same garbage: look at the last few of each
    # partition, in one read (a consumer per offset took ~20 s)
    ends = topic_reader.end_offsets(topics.DEAD_LETTERS.name)
    found = None
    for msg in topic_reader.read_to_end({(topics.DEAD_LETTERS.name, p): max(0, high - 20)
                                         for p, high in ends.items() if high > 0}, timeout=30):
        event = codec.decode(msg.value(), msg.headers())
        if event.record["consumer"] == "test-consumer" and event.record["source_offset"] == offset:
            found = event.record
    assert found is not None
    assert found["value"] == b"\x00garbage" and found["source_topic"] == topics.REQUESTS.name
    assert found["source_partition"] == partition
    assert "corrupt" in found["reason"]
