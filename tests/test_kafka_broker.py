import uuid

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from infra import kafka_clients
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


def test_undecodable_message_goes_to_dead_letters(kafka_bootstrap):
    producer = Producer(kafka_clients.producer_config("t"))
    producer.produce(topics.REQUESTS.name, key=b"x", value=b"\x00garbage",
                     headers=[("tm-event", b"InferenceRequested"), ("tm-schema-version", b"1")])
    producer.flush(10)
    consumer = Consumer(kafka_clients.consumer_config(f"t-{uuid.uuid4().hex}", "t"))
    consumer.subscribe([topics.REQUESTS.name])
    got = None
    for _ in range(100):
        msg = consumer.poll(0.2)
        if msg is not None and not msg.error() and msg.value() == b"\x00garbage":
            got = msg
            break
    assert got is not None
    assert kafka_clients.decode_or_dead_letter(producer, got, "test-consumer") is None
    producer.flush(10)
    dl = Consumer(kafka_clients.consumer_config(f"t-{uuid.uuid4().hex}", "t"))
    dl.subscribe([topics.DEAD_LETTERS.name])
    found = None
    for _ in range(100):
        msg = dl.poll(0.2)
        if msg is not None and not msg.error():
            event = codec.decode(msg.value(), msg.headers())
            if event.record["consumer"] == "test-consumer":
                found = event.record
                break
    assert found is not None
    assert found["value"] == b"\x00garbage" and found["source_topic"] == topics.REQUESTS.name
    assert "corrupt" in found["reason"]
    consumer.close(); dl.close()
