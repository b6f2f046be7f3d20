"""Small readers used when an instance takes the scheduler over.

* ``read_to_end``: every record of a topic from given offsets (or the start) up to the
  end as of the call: the `tenants` catch-up, and the `work` scan that finds releases a
  crashed owner made but did not live to record.
"""
from __future__ import annotations

import uuid
from typing import Iterator

from confluent_kafka import Consumer, TopicPartition

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from schemas import codec


def committed(group_id: str, topic: str, parts: list[int]) -> dict[int, int]:
    """Offsets a consumer group committed on these partitions (those it has)."""
    if not parts:
        return {}
    c = Consumer(kafka_clients.consumer_config(group_id, f"streams-scan-{uuid.uuid4().hex[:8]}"))
    try:
        found = c.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        return {tp.partition: tp.offset for tp in found if tp.offset is not None and tp.offset >= 0}
    finally:
        c.close()


def read_to_end(topic: str, start: dict[int, int] | None, expect: tuple[str, ...] | None,
                timeout: float = 60.0, ends: dict[int, int] | None = None) -> Iterator[tuple[bytes | None, dict | None]]:
    """(key, decoded record or None) for every record from ``start`` (default: the
    beginning) up to ``ends`` (default: the end offsets at the time of the call); records
    that do not decode as one of ``expect`` are skipped (their readers park them)."""
    until = None if ends is None else {(topic, p): e for p, e in ends.items()}
    for msg in topic_reader.read_to_end(topic_reader.whole_topic(topic, start), "streams-scan", timeout, ends=until):
        record = None
        if expect is not None and msg.value() is not None:
            try:
                record = codec.decode(msg.value(), msg.headers(), expect=expect, check=True).record
            except codec.UndecodableEvent:
                continue
        yield msg.key(), record
