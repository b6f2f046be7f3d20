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
from typing import Callable

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from infra import kafka_clients

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


# End offsets unavailable this long: the admin client itself may be the broken one (it asks through
# itself, and a client can fail every call long after the broker is back); make a fresh one.
REPLACE_ADMIN_AFTER_S = 10.0


class FetchWatch:
    def __init__(self, bootstrap: str, stall_after_s: float = STALL_AFTER_S, check_every_s: float = CHECK_EVERY_S,
                 end_offsets: Callable[[list[Key]], dict[Key, int]] | None = None,
                 admin_factory: Callable[[dict], object] = AdminClient):
        self.stall_after_s = stall_after_s
        self.check_every_s = check_every_s
        self._admin_config = kafka_clients.admin_config(bootstrap)
        self._admin_factory = admin_factory
        self._admin = None if end_offsets else admin_factory(self._admin_config)
        self._end_offsets = end_offsets or self._ask_broker
        self._failing_since: float | None = None
        self._lagging: dict[Key, tuple[int, float]] = {}  # partition -> (position, since when) while behind
        self._last_check = float("-inf")

    def _ask_broker(self, keys: list[Key]) -> dict[Key, int]:
        futures = self._admin.list_offsets({TopicPartition(t, p): OffsetSpec.latest() for t, p in keys},
                                           request_timeout=2.0)
        return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}

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
        except (KafkaException, RuntimeError) as exc:  # the broker is away, or this client is broken
            log.debug("end offsets unavailable: %s", exc)
            self._lagging.clear()
            self._failing_since = self._failing_since if self._failing_since is not None else now
            if self._admin is not None and now - self._failing_since >= REPLACE_ADMIN_AFTER_S:
                log.warning("end offsets unavailable for %.0f s; asking through a new admin client",
                            now - self._failing_since)
                self._admin = self._admin_factory(self._admin_config)
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
