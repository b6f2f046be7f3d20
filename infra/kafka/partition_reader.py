"""A group-less reader of fixed partitions that reads on with a fresh client when its fetching stalls.

Every long-lived follower of a topic (the tenant directory, the edge's quota view, a reply partition,
a worker's cancellations) needs the same remedy for the librdkafka leader problem described in
fetch_watch.py: positions kept per partition, and a new client at those positions once records lie
beyond one that the client does not fetch. Seen without it: after a series of broker restarts an
ingress never learned a tenant's new key, so every request with it got 401 for good.
"""
from __future__ import annotations

import logging
from typing import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from infra.kafka import clients as kafka_clients
from infra.kafka.consume import close_in_background, take_available
from infra.kafka.fetch_watch import FetchWatch, Key

log = logging.getLogger(__name__)


class PartitionReader:
    def __init__(self, client_id: str, starts: dict[Key, int], watch: FetchWatch | None = None,
                 consumer_factory: Callable[[dict], Consumer] = Consumer, **overrides):
        """starts: the first offset to read on each partition (OFFSET_BEGINNING, OFFSET_END or a number)."""
        # End-of-partition events move the position over what compaction removed at a partition's
        # end, which no record ever would.
        self._config = kafka_clients.consumer_config(None, client_id, **{"enable.partition.eof": True, **overrides})
        self._factory = consumer_factory
        self._next: dict[Key, int] = dict(starts)  # the next offset to read; negative: a logical start
        self._own_watch = watch is None
        self._watch = watch or FetchWatch(kafka_clients.bootstrap_servers())
        self._consumer = self._open()
        self.replacements = 0

    def _open(self) -> Consumer:
        consumer = self._factory(self._config)
        consumer.assign([TopicPartition(t, p, o) for (t, p), o in self._next.items()])
        return consumer

    def _watched_positions(self) -> dict[Key, int]:
        # Nothing read yet from the beginning counts as offset 0: a client stuck from its first fetch
        # shows as lagging (offsets below a compacted topic's start are skipped by the consumer).
        return {k: 0 if o == OFFSET_BEGINNING else o for k, o in self._next.items()
                if o >= 0 or o == OFFSET_BEGINNING}

    def _check(self) -> None:
        if not self._watch.due():
            return
        stuck = self._watch.stalled(self._watched_positions())
        if not stuck:
            return
        log.warning("%s: records beyond %s are not fetched; reading on with a new client",
                    self._config["client.id"], {f"{t}[{p}]": self._next[(t, p)] for t, p in stuck})
        old, self._consumer = self._consumer, self._open()
        self.replacements += 1
        self._watch.reset()
        close_in_background(old, self._config["client.id"])

    def read(self, timeout: float, max_messages: int = 500) -> list:
        """Records that arrived (errors left out), waiting up to timeout for the first one."""
        self._check()
        taken = take_available(self._consumer, timeout, max_messages)
        for key, end in taken.ends.items():
            self._next[key] = max(self._next.get(key, 0), end)
        for msg in taken.records:
            self._next[(msg.topic(), msg.partition())] = msg.offset() + 1
        return taken.records

    def pause(self) -> None:
        """Stop fetching (librdkafka otherwise keeps prefetching into its queue while nobody reads)."""
        self._consumer.pause([TopicPartition(t, p) for t, p in self._next])

    def resume(self) -> None:
        self._consumer.resume([TopicPartition(t, p) for t, p in self._next])

    def next_offset(self, key: Key) -> int:
        """The next offset to read on a partition (negative: nothing read yet from a logical start)."""
        return self._next[key]

    def close(self) -> None:
        self._consumer.close()
        if self._own_watch:
            self._watch.close()
