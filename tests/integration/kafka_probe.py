"""Reads events off a topic in tests, from the beginning, with a throwaway consumer group."""
from __future__ import annotations

import time
import uuid
from typing import Callable

from confluent_kafka import Consumer

from infra import kafka_clients
from schemas import codec


def wait_for_events(topic: str, predicate: Callable[[codec.Event], bool], count: int = 1,
                    timeout: float = 30.0) -> list[codec.Event]:
    consumer = Consumer(kafka_clients.consumer_config(f"probe-{uuid.uuid4().hex}", "probe"))
    consumer.subscribe([topic])
    found: list[codec.Event] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(found) < count:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            try:
                event = codec.decode(msg.value(), msg.headers())
            except codec.UndecodableEvent:
                continue
            if predicate(event):
                found.append(event)
    finally:
        consumer.close()
    return found
