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

import time
import zlib

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from infra.kafka import topic_reader
from ingress.kafka.reads import ConsumerPool
from ingress.kafka.reply_events import ReplyEvent
from schemas import codec, topics
from schemas.records import ReplyBatch, RequestError

CLOCK_SKEW_MS = 5_000  # the record's creation time against the broker's timestamps


def reply_partition(response_id: str) -> int:
    return zlib.crc32(response_id.encode()) % topics.BATCH_RESULTS.partitions


class BackgroundReplies:
    """One background request's reply events, from the start, as (kind, payload) pairs like the reply
    router's, read through one consumer of `consumers` (given back by `close`). Blocking calls: run them on
    the process's Kafka read pool (ingress/kafka/reads.py), never on the event loop or the default pool."""

    def __init__(self, request_id: str, partition: int, created_at_ms: int, consumers: ConsumerPool):
        self.request_id, self._consumers = request_id, consumers
        self.tp = TopicPartition(topics.BATCH_RESULTS.name, partition)
        self._consumer = consumers.take()
        try:
            start = self._first_offset_since(created_at_ms - CLOCK_SKEW_MS)
            self._consumer.assign([TopicPartition(self.tp.topic, partition, start)])
        except BaseException:
            consumers.give_back(self._consumer)
            raise
        self.position = start
        self._at_end: int | None = None  # the end offset the last end-of-partition event reported

    def _first_offset_since(self, since_ms: int) -> int:
        # The end is read first: a record appended between the two calls lies past it, so starting there
        # when nothing recent was found cannot skip it (topic_reader.first_offset_since, on a reused client).
        end = topic_reader.end_of(self._consumer, self.tp, timeout=10)
        found = self._consumer.offsets_for_times([TopicPartition(self.tp.topic, self.tp.partition, since_ms)],
                                                 timeout=10)[0]
        return found.offset if found.offset >= 0 else end

    def _events_of(self, msg) -> list[ReplyEvent]:
        try:
            event = codec.decode(msg.value(), msg.headers(), expect=("ReplyBatch", "RequestError"), check=True)
        except codec.UndecodableEvent:
            return []  # `batch-results`' own reader (ingress/api/batches/collect.py) parks bad records
        if event.name == "ReplyBatch":
            return [("item", item) for item in codec.record_of(event, ReplyBatch)["items"]
                    if item["request_id"] == self.request_id]
        error = codec.record_of(event, RequestError)
        return [("error", error)] if error["request_id"] == self.request_id else []

    def _consume(self, timeout: float) -> list[ReplyEvent]:
        found: list[ReplyEvent] = []
        for msg in self._consumer.consume(num_messages=500, timeout=timeout):
            if msg.topic() != self.tp.topic or msg.partition() != self.tp.partition:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    self._at_end = msg.offset()
                continue
            offset = msg.offset()
            assert offset is not None  # a delivered message has its place
            if offset < self.position:
                continue  # fetched before a reassignment of this reused consumer
            self.position = offset + 1
            found += self._events_of(msg)
        return found

    def read(self, timeout: float) -> list[ReplyEvent]:
        """This request's events among what arrives within `timeout` (0: what was fetched already; an
        empty list: nothing new yet)."""
        return self._consume(timeout)

    def read_to_end(self, timeout: float = 10.0) -> list[ReplyEvent]:
        """Everything of this request up to the partition's end as of the call. Raises TimeoutError when
        that end was not reached in time: what it read would pass for the whole answer."""
        try:
            end = topic_reader.end_of(self._consumer, self.tp, timeout=min(max(timeout, 1.0), 5.0))
        except KafkaException as exc:  # the broker did not say where the end is: not an answer either
            raise TimeoutError(f"the end of {self.tp.topic}[{self.tp.partition}] is unknown: {exc}") from None
        found: list[ReplyEvent] = []
        deadline = time.monotonic() + timeout
        # Reaching the end is what counts: the end-of-partition event also covers offsets no record is
        # delivered at (transaction markers).
        while self.position < end and not (self._at_end is not None and self._at_end >= end):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"could not read {self.tp.topic}[{self.tp.partition}] to {end} "
                                   f"within {timeout:g} s (at {self.position})")
            found += self._consume(0.2)
        return found

    def close(self) -> None:
        self._consumers.give_back(self._consumer)
