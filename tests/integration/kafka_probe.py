"""Reads events off a topic in tests, from the beginning, with a throwaway consumer."""
from __future__ import annotations

import time
import uuid
from typing import Callable

from confluent_kafka import Consumer, TopicPartition

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from schemas import codec
from tests.support.waiting import wait_until


def _matching(msg, predicate: Callable[[codec.Event], bool]) -> codec.Event | None:
    """The message's event if it decodes and matches (tests skip what they cannot read)."""
    if msg is None or msg.error():
        return None
    try:
        event = codec.decode(msg.value(), msg.headers())
    except codec.UndecodableEvent:
        return None
    return event if predicate(event) else None


def wait_for_events(topic: str, predicate: Callable[[codec.Event], bool], count: int = 1,
                    timeout: float = 30.0) -> list[codec.Event]:
    """Up to `count` matching events, waiting at most `timeout` for them."""
    consumer = Consumer(kafka_clients.consumer_config(f"probe-{uuid.uuid4().hex}", "probe"))
    consumer.subscribe([topic])
    found: list[codec.Event] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(found) < count:
            event = _matching(consumer.poll(0.2), predicate)
            if event is not None:
                found.append(event)
    finally:
        consumer.close()
    return found


def read_to_end(topic: str, predicate: Callable[[codec.Event], bool], timeout: float = 30) -> list[codec.Event]:
    """Every matching event on `topic`, from the beginning up to its end as of the call."""
    found = []
    for msg in topic_reader.read_to_end(topic_reader.whole_topic(topic), "probe", timeout):
        event = _matching(msg, predicate)
        if event is not None:
            found.append(event)
    return found


def wait_committed_past(group_id: str, topic: str, predicate: Callable[[codec.Event], bool],
                        timeout: float = 30) -> None:
    """Once consumer group `group_id` has committed past every matching event on `topic` (as of the
    call): no member of the group is handed those events again."""
    last: dict[int, int] = {}
    for msg in topic_reader.read_to_end(topic_reader.whole_topic(topic), "probe", timeout):
        if _matching(msg, predicate) is not None:
            last[msg.partition()] = max(last.get(msg.partition(), -1), msg.offset())
    assert last, f"no matching event on {topic}"
    consumer = Consumer(kafka_clients.consumer_config(group_id, "probe"))  # never subscribes: only reads

    def past() -> bool:
        committed = consumer.committed([TopicPartition(topic, p) for p in last], timeout=10)
        return all(tp.offset > last[tp.partition] for tp in committed)

    try:
        wait_until(past, timeout, f"{group_id} committing past {last} on {topic}", every=0.1)
    finally:
        consumer.close()
