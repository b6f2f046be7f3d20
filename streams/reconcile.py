"""Small readers used when an instance takes the scheduler over.

* ``read_to_end``: every record of a topic from given offsets (or the start) up to the
  end as of the call: the `tenants` catch-up, and the `work` scan that finds releases a
  crashed owner made but did not live to record.
"""
from __future__ import annotations

import time
import uuid
from typing import Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from infra import kafka_clients
from schemas import codec


def _consumer() -> Consumer:
    return Consumer(kafka_clients.consumer_config(None, f"streams-scan-{uuid.uuid4().hex[:8]}",
                                                  **{"enable.partition.eof": True}))


def partitions(topic: str) -> list[int]:
    c = _consumer()
    try:
        meta = c.list_topics(topic, timeout=10).topics[topic]
        if meta.error is not None:
            raise RuntimeError(f"topic {topic}: {meta.error}")
        return sorted(meta.partitions)
    finally:
        c.close()


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


def end_offsets(topic: str) -> dict[int, int]:
    c = _consumer()
    try:
        meta = c.list_topics(topic, timeout=10).topics[topic]
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in meta.partitions}
    finally:
        c.close()


def read_to_end(topic: str, start: dict[int, int] | None, expect: tuple[str, ...] | None,
                timeout: float = 60.0) -> Iterator[tuple[bytes | None, dict | None]]:
    """(key, decoded record or None) for every record from ``start`` (default: the
    beginning) up to the end offsets at the time of the call."""
    c = _consumer()
    try:
        meta = c.list_topics(topic, timeout=10).topics[topic]
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in meta.partitions}
        begin = {p: (start or {}).get(p, OFFSET_BEGINNING) for p in meta.partitions}
        todo = {p for p in ends if ends[p] > 0 and (begin[p] == OFFSET_BEGINNING or begin[p] < ends[p])}
        if not todo:
            return
        c.assign([TopicPartition(topic, p, begin[p]) for p in todo])
        deadline = time.monotonic() + timeout
        while todo and time.monotonic() < deadline:
            for msg in c.consume(num_messages=500, timeout=0.2):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        todo.discard(msg.partition())
                    continue
                if msg.offset() + 1 >= ends[msg.partition()]:
                    todo.discard(msg.partition())
                if msg.offset() >= ends[msg.partition()]:
                    continue
                record = None
                if expect is not None and msg.value() is not None:
                    try:
                        record = codec.decode(msg.value(), msg.headers(), expect=expect, check=True).record
                    except codec.UndecodableEvent:
                        continue
                yield msg.key(), record
        if todo:
            raise TimeoutError(f"could not read {topic} to its end (partitions {sorted(todo)})")
    finally:
        c.close()
