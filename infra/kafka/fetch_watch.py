"""Notices a partition a consumer should be reading but is not: records beyond its position that
it does not fetch, while the broker answers.

The consumer side of the librdkafka leader problem (see resilient_producer.py): after a broker
restart a fetch response naming leader -1 can leave one partition unfetched for good, while the
client's other partitions flow. Seen here on `capacity`: streams stopped seeing worker adverts, so
it released nothing and shed every request at its deadline. The remedy is a fresh client at the
same positions; this class only says when.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from confluent_kafka import Consumer, KafkaException, TopicPartition

from infra.kafka import clients as kafka_clients
from infra.kafka.consume import close_in_background

log = logging.getLogger(__name__)

# On the token path a fetch normally follows an append within milliseconds; what a stall costs is
# a client replaced (and for a group member a rejoin), so a few seconds is cheap insurance.
STALL_AFTER_S = 3.0
CHECK_EVERY_S = 1.0

Key = tuple[str, int]


def group_positions(consumer) -> dict[Key, int]:
    """A group consumer's position on each assigned partition. A partition whose fetching never
    started has no position yet; it counts from its committed offset (one broker call)."""
    positions = {(tp.topic, tp.partition): tp.offset for tp in consumer.position(consumer.assignment())}
    unstarted = [TopicPartition(t, p) for (t, p), o in positions.items() if o < 0]
    if unstarted:
        for tp in consumer.committed(unstarted, timeout=2):
            positions[(tp.topic, tp.partition)] = tp.offset
    return positions


# End offsets unavailable this long: the client that asks may itself be the broken one (a client can
# fail every call long after the broker is back); make a fresh one.
REPLACE_CLIENT_AFTER_S = 10.0
ASK_TIMEOUT_S = 2.0
# ListOffsets with these "timestamps" answer each partition's end (for a read_committed client, the
# end of what a reader can read: open transactions excluded) and the start of its log.
LATEST = -1
EARLIEST = -2


def ends_client(config: dict) -> Consumer:
    return Consumer(config)


class FetchWatch:
    def __init__(self, bootstrap: str, stall_after_s: float = STALL_AFTER_S, check_every_s: float = CHECK_EVERY_S,
                 end_offsets: Callable[[list[Key]], dict[Key, int]] | None = None,
                 log_starts: Callable[[list[Key]], dict[Key, int]] | None = None,
                 client_factory: Callable[[dict], Any] = ends_client):
        self.stall_after_s = stall_after_s
        self.check_every_s = check_every_s
        # A consumer that joins no group and reads nothing: it only asks for partition ends, as every
        # reader's own client would (same isolation level).
        self._client_config = kafka_clients.consumer_config(None, "fetch-watch", **{"bootstrap.servers": bootstrap})
        self._client_factory = client_factory
        self._client: Any = None if end_offsets else client_factory(self._client_config)
        self._end_offsets = end_offsets or (lambda keys: self._ask_broker(keys, LATEST))
        self._log_starts = log_starts or (lambda keys: self._ask_broker(keys, EARLIEST))
        self._failing_since: float | None = None
        self._lagging: dict[Key, tuple[int, float]] = {}  # partition -> (position, since when) while behind
        self._last_check = float("-inf")

    def _ask_broker(self, keys: list[Key], timestamp: int) -> dict[Key, int]:
        # Fresh metadata first, every time, so that the ends are asked of the current leaders: after a
        # broker of a cluster died, a client asked on what it first saw (an admin client's list_offsets
        # did: it then reconnected to the dead broker in a tight loop, a core busy per client in every
        # process, and failed until the client was replaced). A partition with no live leader has no
        # end to ask for now; it is left out.
        asked = []
        for topic in sorted({t for t, _ in keys}):
            meta = self._client.list_topics(topic=topic, timeout=ASK_TIMEOUT_S)
            partitions = meta.topics[topic].partitions if topic in meta.topics else {}
            asked += [(t, p) for t, p in keys
                      if t == topic and p in partitions and partitions[p].leader in meta.brokers]
        if not asked:
            return {}
        answers = self._client.offsets_for_times([TopicPartition(t, p, timestamp) for t, p in asked],
                                                 timeout=ASK_TIMEOUT_S)
        return {(tp.topic, tp.partition): tp.offset for tp in answers if tp.error is None and tp.offset >= 0}

    def due(self, now: float | None = None) -> bool:
        """Whether stalled() would ask the broker now (so a caller can skip gathering positions)."""
        return (time.monotonic() if now is None else now) - self._last_check >= self.check_every_s

    def stalled(self, positions: dict[Key, int], now: float | None = None) -> list[Key]:
        """Partitions whose position has not moved for stall_after_s although the broker has records
        beyond it. Asks the broker at most every check_every_s; [] in between and during an outage."""
        now = time.monotonic() if now is None else now
        if now - self._last_check < self.check_every_s or not positions:
            return []
        self._last_check = now
        try:
            ends = self._end_offsets(list(positions))
            # A partition never fetched, of a group that never committed it (a new pool's, on a fresh
            # broker), has no position yet (group_positions); the group's reset policy (earliest,
            # kafka_clients.consumer_config) starts it at the start of its log. Without one it could sit
            # unfetched with records waiting and never count as stalled.
            unstarted = [key for key, position in positions.items() if position < 0 and ends.get(key, 0) > 0]
            if unstarted:
                positions = {**positions, **self._log_starts(unstarted)}
        except (KafkaException, RuntimeError) as exc:  # the broker is away, or this client is broken
            log.debug("end offsets unavailable: %s", exc)
            self._lagging.clear()
            self._failing_since = self._failing_since if self._failing_since is not None else now
            if self._client is not None and now - self._failing_since >= REPLACE_CLIENT_AFTER_S:
                log.warning("end offsets unavailable for %.0f s; asking through a new client",
                            now - self._failing_since)
                old, self._client = self._client, self._client_factory(self._client_config)
                close_in_background(old, "fetch-watch")
                self._failing_since = now
            return []
        self._failing_since = None
        stuck = []
        for key, position in positions.items():
            end = ends.get(key)
            if end is None or position < 0 or end <= position:
                self._lagging.pop(key, None)
                continue
            seen = self._lagging.get(key)
            if seen is None or seen[0] != position:
                self._lagging[key] = (position, now)
            elif now - seen[1] >= self.stall_after_s:
                stuck.append(key)
        return stuck

    def reset(self) -> None:
        self._lagging.clear()

    def close(self) -> None:
        """Close the client that asks for the ends (one a reader closes need not linger)."""
        if self._client is not None:
            self._client.close()
