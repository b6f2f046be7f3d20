"""Which reply addresses still have a reader.

Each ingress process beats on `ingress-heartbeats` for its reply partition. A request
whose ingress stopped beating, said it is stopping, or was replaced by a newer process
on the same partition has nobody left to stream to; the worker cancels it and frees
its slot instead of generating into the void.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from infra import kafka_clients
from schemas import topics

MISSED_BEATS = 5


@dataclass
class Beat:
    incarnation: str
    timestamp_ms: int
    interval_ms: int
    stopping: bool


class HeartbeatTable:
    """The latest beat per reply address, and the verdict on a request (pure, no I/O)."""

    def __init__(self):
        self.beats: dict[tuple[str, int], Beat] = {}

    def observe(self, beat: dict) -> None:
        address = (beat["reply_topic"], beat["reply_partition"])
        known = self.beats.get(address)
        if known is None or beat["timestamp_ms"] >= known.timestamp_ms:
            self.beats[address] = Beat(beat["incarnation"], beat["timestamp_ms"], beat["interval_ms"],
                                       beat["stopping"])

    def gone(self, record: dict, now_ms: int | None = None) -> bool:
        """Whether nobody will read this request's replies any more."""
        incarnation = record.get("reply_incarnation")
        if incarnation is None:  # batch results are collected later, from the topic
            return False
        beat = self.beats.get((record["reply_topic"], record["reply_partition"]))
        if beat is None:
            return False
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if beat.incarnation != incarnation:
            # a newer process took the partition over after this request arrived
            return beat.timestamp_ms > record["arrived_at_ms"]
        return beat.stopping or now_ms - beat.timestamp_ms > MISSED_BEATS * beat.interval_ms


class ReplyReaders(HeartbeatTable):
    """A HeartbeatTable kept current from the `ingress-heartbeats` topic."""

    def __init__(self, client_id: str):
        super().__init__()
        self._consumer = Consumer(kafka_clients.consumer_config(None, f"{client_id}-heartbeats"))
        self._dead_letters = kafka_clients.DeadLetters(f"{client_id}-heartbeats")
        meta = kafka_clients.with_retries(
            lambda: self._consumer.list_topics(topics.INGRESS_HEARTBEATS.name, timeout=10),
            "reading `ingress-heartbeats` metadata").topics[topics.INGRESS_HEARTBEATS.name]
        self._consumer.assign([TopicPartition(topics.INGRESS_HEARTBEATS.name, p, OFFSET_BEGINNING)
                               for p in meta.partitions])

    def poll(self) -> None:
        for msg in self._consumer.consume(num_messages=500, timeout=0):
            if msg.error() or msg.value() is None:
                continue
            event = self._dead_letters.decode(msg, ("IngressHeartbeat",))
            if event is None:
                continue  # the address keeps its last good beat
            try:
                self.observe(event.record)
            except Exception as exc:
                self._dead_letters.unprocessable(msg, exc)

    def close(self) -> None:
        self._consumer.close()
        self._dead_letters.flush()
