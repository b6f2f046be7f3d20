"""Which redelivered requests a previous owner of their `work` partition already recorded on `usage`.

A request's work offset is committed once its last reply and its RequestCompleted are delivered
(after_delivery.py), asynchronously. A worker killed after the delivery but before the commit lands
leaves a request that is finished and recorded, yet still past the committed offset: the partition's
next owner runs it again. Running it again is right (the client may still be missing the tail of its
stream, and regeneration is deterministic), but recording it again is not: every admitted request ends
in exactly one RequestCompleted. So the first record a worker takes from a newly assigned partition
that was released before the assignment makes it read `usage` from a little before that record's
release to the end, once, and a request found there is run without a second RequestCompleted.

The previous owner is gone by the time the group hands its partitions over, so nothing it produced
can still be on its way; a read that fails leaves the request to be recorded again, as before this
check (billing keeps one ledger row per request id).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

log = logging.getLogger(__name__)

# At most this many request ids are kept from the reads (the oldest go first): a read covers every
# completion since the oldest redelivered release, far more than will run again.
MAX_REMEMBERED = 200_000
# Clocks of streams (which stamps the release) and of the worker that recorded the completion may
# differ; a read from this much before the release still finds the completion.
CLOCK_MARGIN_MS = 5_000


def completions_since(since_ms: int, topic: str | None = None) -> set[str]:
    """Request ids of every RequestCompleted on `usage` (or `topic`) stamped since `since_ms`, read to
    the end of each partition as it is now."""
    from infra.kafka import topic_reader
    from schemas import codec, topics

    topic = topic or topics.USAGE.name
    found = set()
    for msg in topic_reader.read_to_end(topic_reader.whole_topic(topic), client_id="worker-recorded-usage",
                                        timeout=30, since_ms=since_ms):
        try:
            event = codec.decode(msg.value(), msg.headers(), expect=("RequestCompleted",))
        except codec.UndecodableEvent:
            continue  # not ours to dead-letter: billing does, for the records it reads
        found.add(event.record["request_id"])
    return found


class RecordedUsage:
    def __init__(self, read: Callable[[int], set[str]] = completions_since,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)):
        self._read = read
        self._clock_ms = clock_ms
        self._assigned_at: dict[int, int] = {}  # partition -> when assigned, until its first record is seen
        self._read_since: int | None = None  # the earliest stamp a read so far covered (to its end)
        self._recorded: dict[str, None] = {}  # an ordered set

    def assigned(self, partitions: Iterable[int]) -> None:
        now = self._clock_ms()
        for partition in partitions:
            self._assigned_at[partition] = now
        # what an earlier read found may since have been recorded again elsewhere: read afresh
        self._read_since = None

    def forget(self, partition: int) -> None:
        self._assigned_at.pop(partition, None)

    def taken(self, partition: int, released_at_ms: int) -> None:
        """A record of `partition` released at `released_at_ms` was taken in; the first one after an
        assignment that predates it may have run under the previous owner."""
        assigned_at = self._assigned_at.pop(partition, None)
        if assigned_at is None or released_at_ms >= assigned_at + CLOCK_MARGIN_MS:
            return
        if released_at_ms <= 0:
            # no CreateTime (TIMESTAMP_NOT_AVAILABLE): reading `usage` from its start is unbounded, and
            # recording twice is what billing de-duplicates
            return
        since = released_at_ms - CLOCK_MARGIN_MS
        if self._read_since is not None and since >= self._read_since:
            return  # an earlier read since this assignment covered it
        try:
            found = self._read(since)
        except Exception as exc:  # noqa: BLE001 - recording twice is what billing de-duplicates
            log.warning("could not read `usage` for requests work partition %d redelivers: %s", partition, exc)
            return
        self._read_since = since
        for request_id in found:
            self._recorded[request_id] = None
        while len(self._recorded) > MAX_REMEMBERED:
            del self._recorded[next(iter(self._recorded))]
        log.info("read `usage` since %d for work partition %d: %d completions", since, partition, len(found))

    def already_recorded(self, request_id: str) -> bool:
        """True once per request a previous owner recorded (then forgotten: its offset is done)."""
        if request_id in self._recorded:
            del self._recorded[request_id]
            return True
        return False
