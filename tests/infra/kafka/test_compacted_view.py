"""The compacted-topic follower behind every materialized view, on a real broker: it applies every record
from the beginning, parks a record its view cannot apply and reads on, and says when it holds what the
topic held at start or holds now (also when compaction or a pause is in the way)."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from infra.kafka import clients as kafka_clients
from infra.kafka.compacted_view import CompactedFollower

pytestmark = pytest.mark.kafka


def _topic(kafka_bootstrap, partitions: int = 2) -> str:
    name = f"view-test-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1, config={"cleanup.policy": "compact"})])[name].result(15)
    return name


def _produce(topic: str, records: list[tuple[int, bytes, bytes | None]]) -> None:
    producer = Producer(kafka_clients.producer_config("view-test"))
    for partition, key, value in records:
        producer.produce(topic, key=key, value=value, partition=partition)
    assert producer.flush(15) == 0


class View:
    def __init__(self):
        self.values: dict[bytes, bytes] = {}

    def apply(self, msg) -> None:
        if msg.value() == b"poison":
            raise ValueError("cannot apply this")
        if msg.value() is None:
            self.values.pop(msg.key(), None)
        else:
            self.values[msg.key()] = msg.value()


class Parked(kafka_clients.DeadLetters):
    def __init__(self):
        super().__init__(None)
        self.parked: list[tuple[int, str]] = []

    def send(self, msg, reason: str) -> None:
        self.parked.append((msg.offset(), reason))


def test_it_holds_what_the_topic_held_at_start_and_parks_what_it_cannot_apply(kafka_bootstrap):
    topic = _topic(kafka_bootstrap)
    _produce(topic, [(0, b"a", b"1"), (0, b"a", b"poison"), (1, b"b", b"2"), (0, b"c", b"3"), (0, b"c", None)])
    view, parked = View(), Parked()
    follower = CompactedFollower(topic, "view-test", view.apply, dead_letters=parked)
    follower.start()
    try:
        assert follower.wait_caught_up(30)
        assert view.values == {b"a": b"1", b"b": b"2"}  # the tombstone removed c; the poison was parked
        assert [(offset, reason.split(":")[0]) for offset, reason in parked.parked] == [(1, "unprocessable")]
        _produce(topic, [(1, b"b", b"4")])
        ends = follower.ends_now()
        assert follower.read_at(ends, 30, lambda: dict(view.values)) == {b"a": b"1", b"b": b"4"}
    finally:
        follower.stop()


def test_settled_waits_for_what_the_topic_holds_now_and_a_paused_follower_does_not_get_there(kafka_bootstrap):
    topic = _topic(kafka_bootstrap, partitions=1)
    view = View()
    follower = CompactedFollower(topic, "view-test", view.apply, partitions=[0])
    follower.start()
    try:
        follower.pause()
        _produce(topic, [(0, f"k{i}".encode(), b"v") for i in range(50)])
        with pytest.raises(TimeoutError):
            follower.read_at(follower.ends_now(), 1.0, lambda: None)
        assert asyncio.run(follower.settled(0.5)) is False
        follower.resume()
        assert asyncio.run(follower.settled(30)) is True
        assert len(view.values) == 50
    finally:
        follower.stop()


def test_an_empty_topic_is_caught_up_at_once(kafka_bootstrap):
    topic = _topic(kafka_bootstrap)
    follower = CompactedFollower(topic, "view-test", View().apply)
    follower.start()
    try:
        assert follower.wait_caught_up(30)
        assert asyncio.run(follower.settled(10)) is True
    finally:
        follower.stop()
