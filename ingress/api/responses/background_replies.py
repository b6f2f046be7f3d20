"""The answer of a background response, read back from Kafka by whichever ingress process is asked.

A background response (`POST /v1/responses` with ``background: true``) is queued with `batch-results` as
its reply address (the partition is a hash of the response id), like a line of an offline batch: no ingress
process waits for it, so workers never cancel it for want of a reader (gpu_consumers/reply_readers.py), and
its reply events stay on the topic for its retention (7 days). Polling it, streaming it, or resuming a stream
from ``starting_after`` on any process reads that partition from the response's creation time on,
keeping the events of its request: the same events in the same order every time, so the typed stream
events derived from them get the same sequence numbers on every process.
"""
from __future__ import annotations

import zlib

from confluent_kafka import Consumer, TopicPartition

from infra import kafka_clients, topic_reader
from schemas import codec, topics

CLOCK_SKEW_MS = 5_000  # the record's creation time against the broker's timestamps


def reply_partition(response_id: str) -> int:
    return zlib.crc32(response_id.encode()) % topics.BATCH_RESULTS.partitions


class BackgroundReplies:
    """One background request's reply events, from the start, as (kind, payload) pairs like the reply
    router's. Blocking calls: run them off the event loop."""

    def __init__(self, request_id: str, partition: int, created_at_ms: int, client_id: str):
        self.request_id, self.client_id = request_id, client_id
        self.tp = TopicPartition(topics.BATCH_RESULTS.name, partition)
        start = topic_reader.first_offset_since(self.tp.topic, partition, created_at_ms - CLOCK_SKEW_MS, client_id)
        self._consumer = Consumer(kafka_clients.consumer_config(None, client_id, **{"fetch.wait.max.ms": 20}))
        self._consumer.assign([TopicPartition(self.tp.topic, partition, start)])
        self.position = start

    def _events_of(self, msg) -> list[tuple[str, dict]]:
        try:
            event = codec.decode(msg.value(), msg.headers(), expect=("ReplyBatch", "RequestError"), check=True)
        except codec.UndecodableEvent:
            return []  # `batch-results`' own reader (ingress/api/batches/collect.py) parks bad records
        if event.name == "ReplyBatch":
            return [("item", item) for item in event.record["items"] if item["request_id"] == self.request_id]
        return [("error", event.record)] if event.record["request_id"] == self.request_id else []

    def read(self, timeout: float) -> list[tuple[str, dict]]:
        """This request's events among what arrives within `timeout` (an empty list: nothing new yet)."""
        found: list[tuple[str, dict]] = []
        for msg in self._consumer.consume(num_messages=500, timeout=timeout):
            if msg.error():
                continue
            self.position = msg.offset() + 1
            found += self._events_of(msg)
        return found

    def read_to_end(self, timeout: float = 10.0) -> list[tuple[str, dict]]:
        """Everything of this request up to the partition's end as of the call. Raises TimeoutError when
        that end was not reached in time: what it read would pass for the whole answer."""
        found: list[tuple[str, dict]] = []
        key = (self.tp.topic, self.tp.partition)
        for msg in topic_reader.read_to_end({key: self.position}, self.client_id, timeout):
            self.position = msg.offset() + 1
            found += self._events_of(msg)
        return found

    def close(self) -> None:
        self._consumer.close()
