"""Reading a topic once, up to where it ends now: the one implementation every catch-up uses (the
tenant directory and admin, streams' takeover scans, batch collection, usage reconciliation, tests).

For following a topic forever, see partition_reader.py.
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from infra.kafka import clients as kafka_clients

Key = tuple[str, int]


def _client(client_id: str, **overrides) -> Consumer:
    return Consumer(kafka_clients.consumer_config(None, f"{client_id}-{uuid.uuid4().hex[:8]}",
                                                  **{"enable.partition.eof": True, **overrides}))


def partitions(topic: str, client_id: str = "topic-reader", **overrides) -> list[int]:
    c = _client(client_id, **overrides)
    try:
        meta = c.list_topics(topic, timeout=10).topics[topic]
        if meta.error is not None:
            raise RuntimeError(f"topic {topic}: {meta.error}")
        return sorted(meta.partitions)
    finally:
        c.close()


def _bounds(c: Consumer, topic: str, partitions: list[int] | None, timeout: float) -> dict[int, tuple[int, int]]:
    if partitions is None:
        meta = c.list_topics(topic, timeout=timeout).topics[topic]
        if meta.error is not None:
            raise RuntimeError(f"topic {topic}: {meta.error}")
        partitions = list(meta.partitions)
    return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout) for p in partitions}


def _ends(c: Consumer, topic: str, partitions: list[int] | None, timeout: float) -> dict[int, int]:
    return {p: high for p, (_, high) in _bounds(c, topic, partitions, timeout).items()}


def end_of(consumer: Consumer, tp: TopicPartition, timeout: float) -> int:
    """One partition's end offset asked on a client the caller holds, never from its cache (a reader that
    already holds an assigned client, where a second connection would cost more than the wait)."""
    return consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=timeout, cached=False)[1]


def end_offsets(topic: str, client_id: str = "topic-reader") -> dict[int, int]:
    """Each partition of the topic and the offset its next record will get."""
    c = _client(client_id)
    try:
        return _ends(c, topic, None, 10)
    finally:
        c.close()


class EndProbe:
    """`end_offsets` asked again and again (a follower's "have I read what the topic holds now?") on one
    client kept for it, made on first use. Safe to call from several threads.

    Its client never fetches, and that is the point: a broker answers one connection's requests in order,
    so asked on a consumer that is fetching, an offsets request waits behind the fetch's long poll
    (`fetch.wait.max.ms`, 100 ms here): measured on a 2-core VM, 55 ms a partition there, 1.8 ms here."""

    def __init__(self, client_id: str):
        self.client_id = client_id
        self._client: Consumer | None = None
        self._lock = threading.Lock()

    def ends(self, topic: str, partitions: list[int] | None = None, timeout: float = 5.0) -> dict[int, int]:
        return {p: high for p, (_, high) in self.bounds(topic, partitions, timeout).items()}

    def bounds(self, topic: str, partitions: list[int] | None = None,
               timeout: float = 5.0) -> dict[int, tuple[int, int]]:
        """Each partition's first retained offset and end offset."""
        with self._lock:
            if self._client is None:
                self._client = _client(self.client_id)
            return _bounds(self._client, topic, partitions, timeout)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def first_offset_since(topic: str, partition: int, since_ms: int, client_id: str = "topic-reader") -> int:
    """The offset of the partition's first record stamped at or after since_ms, or its end when none is."""
    c = _client(client_id)
    try:
        # The end is read first: a record appended between the two calls lies past it, so starting
        # there when nothing recent was found cannot skip it (read after, it would be skipped).
        end = c.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)[1]
        found = c.offsets_for_times([TopicPartition(topic, partition, since_ms)], timeout=10)[0]
        return found.offset if found.offset >= 0 else end
    finally:
        c.close()


def whole_topic(topic: str, start: dict[int, int] | None = None) -> dict[Key, int]:
    """Every partition of a topic, from `start`'s offset where it names one, else from the beginning."""
    return {(topic, p): (start or {}).get(p, OFFSET_BEGINNING) for p in partitions(topic)}


def read_to_end(starts: dict[Key, int], client_id: str = "topic-reader", timeout: float = 60.0,
                ends: dict[Key, int] | None = None, since_ms: int | None = None, **overrides) -> Iterator:
    """Every record from each partition's start (an offset or OFFSET_BEGINNING) up to its end offset
    as of the call (or the end given in `ends`), partitions interleaved, each in offset order. With
    `since_ms`, a partition starts at its first record stamped at or after that time instead.

    Raises TimeoutError naming what was left unread past `timeout`: a caller that acts on a partial
    read (a catch-up that then writes) must not get one silently."""
    c = _client(client_id, **overrides)
    try:
        if since_ms is not None:
            found = c.offsets_for_times([TopicPartition(t, p, since_ms) for t, p in starts], timeout=10)
            starts = {(tp.topic, tp.partition): tp.offset for tp in found}  # -1: nothing that recent
        if ends is None:
            ends = {(t, p): c.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1] for t, p in starts}
        todo = {k: ends[k] for k, start in starts.items()
                if ends[k] > 0 and (start == OFFSET_BEGINNING or 0 <= start < ends[k])}
        if not todo:
            return
        c.assign([TopicPartition(t, p, starts[(t, p)]) for t, p in todo])
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"could not read to the end of {sorted(todo)} within {timeout:g} s")
            for msg in c.consume(num_messages=1000, timeout=0.2):
                key = (msg.topic(), msg.partition())
                if key not in todo:
                    continue
                err = msg.error()
                if err is not None:
                    # The end, even where compaction removed the last offsets below it.
                    if err.code() == KafkaError._PARTITION_EOF:
                        del todo[key]
                    continue
                offset = msg.offset()
                if offset is None or offset >= todo[key]:
                    del todo[key]  # written after the call: not ours to read (a record always has an offset)
                    continue
                if offset + 1 >= todo[key]:
                    del todo[key]
                yield msg
    finally:
        c.close()
