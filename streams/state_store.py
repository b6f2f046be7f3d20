"""The gate's durable state: a compacted topic of our own, followed by every instance.

Why not a Faust table: Faust's table recovery can wait forever for a changelog partition it
was assigned but never fetched (seen after broker restarts: "Stream has not started processing
TP(...-state-changelog, 0)" once a second, for minutes, with the scheduler held and idle). The
state has one partition and one writer, so what the table gave us is small enough to own:

* **writing**: the owner produces ``key -> JSON`` (``None`` deletes, as a tombstone) with its own
  idempotent producer, after the outputs those entries follow from are confirmed (owner.py);
* **following**: every instance, active or standby, tails the topic in a background thread
  and keeps the latest value per key, so a standby is hot and a takeover reads only the tail;
* **catching up**: on takeover, ``snapshot()`` asks the broker for the partition's end and
  returns once everything before it is applied. It either finishes or raises after a bound;
  it never waits on a rebalance, a stream or anything else.

The topic keeps the name the Faust table used (``<app id>-state-changelog``), and the records are
the same (raw key, JSON value, tombstones), so an installation upgrades in place.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from confluent_kafka import Producer

from infra.kafka import clients as kafka_clients
from infra.kafka.compacted_view import CompactedFollower

log = logging.getLogger("tokenmill.streams.state")

PARTITION = 0


def encode_entries(dirty: dict[str, Any]) -> list[tuple[bytes, bytes | None]]:
    """Table entries as records: JSON values, None (a deleted entry) as a tombstone."""
    # orjson: the owner writes every request's entry two or three times, and the standard
    # library's encoder was a tenth of the gate's time.
    return [(key.encode(), None if value is None else orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS))
            for key, value in dirty.items()]


def decode_entries(raw: dict[bytes, bytes]) -> dict[str, Any]:
    return {k.decode(): orjson.loads(v) for k, v in raw.items()}


class StateView:
    """The latest value per key of the state topic, and how far it has been read (pure, no I/O)."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.next_offset = 0

    def apply(self, offset: int, key: bytes | None, value: bytes | None) -> None:
        if offset < self.next_offset:
            return  # a redelivery after a reconnect
        self.next_offset = offset + 1
        if key is None:
            return
        if value is None:
            self.values.pop(key, None)
        else:
            self.values[key] = value

    def reached(self, end: int) -> None:
        self.next_offset = max(self.next_offset, end)


class StateFollower:
    """Tails the state topic into a StateView on a thread of its own (infra/kafka/compacted_view.py)."""

    def __init__(self, topic: str, client_id: str) -> None:
        self.topic = topic
        self.view = StateView()
        # Reads on with a new client should its fetching stall after a broker restart (a standby
        # would otherwise never finish a snapshot and so never take over).
        self._follower = CompactedFollower(topic, f"{client_id}-state", self._apply, partitions=[PARTITION],
                                           max_messages=1000)
        self._follower.start()

    def _apply(self, msg) -> None:
        self.view.apply(msg.offset(), msg.key(), msg.value())

    def pause(self) -> None:
        """Stop reading (the owner writes the topic and has what it holds in memory; reading its own
        writes back cost it a tenth of its time). ``resume`` reads on from where it stopped."""
        self._follower.pause()

    def resume(self) -> None:
        self._follower.resume()

    def snapshot(self, timeout: float = 20.0) -> dict[str, Any]:
        """Every entry written before this call, decoded. Raises TimeoutError past ``timeout``."""
        self.resume()
        deadline = time.monotonic() + timeout
        ends = kafka_clients.with_retries(lambda: self._follower.ends_now(), "reading the end of the state topic",
                                          timeout=timeout)
        raw = self._follower.read_at(ends, deadline - time.monotonic(), lambda: dict(self.view.values))
        return decode_entries(raw)

    def close(self) -> None:
        self._follower.stop()


def write(producer: Producer, topic: str, dirty: dict[str, Any]) -> None:
    """Queue the entries on the owner's producer; its next flush confirms them."""
    for key, value in encode_entries(dirty):
        while True:
            try:
                producer.produce(topic, key=key, value=value, partition=PARTITION)
                break
            except BufferError:
                producer.poll(0.05)
