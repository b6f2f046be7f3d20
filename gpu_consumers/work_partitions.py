"""The worker's membership of its model's `work` consumer group: which partitions it reads, where
each starts, and the commits that move past requests once they ended.

Offsets are committed only once a request has ended and its last events are delivered
(after_delivery.py), so a crashed worker's requests are redelivered and regenerated.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from confluent_kafka import Consumer, TopicPartition

from gpu_consumers.after_delivery import OffsetSettlements
from gpu_consumers.offset_tracker import OffsetTracker
from gpu_consumers.recorded_usage import RecordedUsage
from infra.kafka import clients as kafka_clients
from infra.kafka.group_consumer import TOKEN_PATH, HealingGroupConsumer
from schemas import topics

log = logging.getLogger("tokenmill.worker")

COMMIT_INTERVAL_S = 0.2
# How long a revoke waits for the delivery reports of what ended here, so that the next owner of the
# partitions does not run it again; bounded, because a rebalance waits on it.
REVOKE_FLUSH_S = 2.0
# Reads of the committed offsets at an assignment before falling back to librdkafka (see on_assign).
COMMITTED_READ_ATTEMPTS = 3


class WorkPartitions:
    """`take_down(partitions)` stops what runs from partitions this worker gave up; `announce()` tells
    the gate the assignment changed (a capacity advert)."""

    def __init__(self, model_name: str, worker_id: str, producer: Any, settlements: OffsetSettlements,
                 recorded_usage: RecordedUsage, *, take_down: Callable[[set[int]], None],
                 on_assigned: Callable[[], None], announce: Callable[[], None]):
        self.model_name = model_name
        self.worker_id = worker_id
        self.producer = producer
        self.settlements = settlements
        self.offsets: OffsetTracker = settlements.offsets
        self.recorded_usage = recorded_usage
        self.take_down = take_down
        self.on_assigned = on_assigned
        self.announce = announce
        self.assigned = False  # credits only make sense once this worker actually reads `work`
        self.numbers: set[int] = set()  # the `work` partitions assigned to this worker
        self._last_commit = 0.0
        self._committing: dict[int, tuple[int, str]] = {}
        self.group = HealingGroupConsumer(topics.WORK.name, self.new_client, "work consumer", TOKEN_PATH,
                                          on_assign=self.on_assign, on_revoke=self.on_revoke,
                                          on_lost=self.on_lost)

    @property
    def consumer(self) -> Consumer:
        """The current `work` client (a fresh one after healing; see infra/kafka/group_consumer.py)."""
        return self.group.client

    def new_client(self) -> Consumer:
        # Static membership (the worker id is the member's instance id): a worker whose session lapsed
        # while the broker was away, or that was restarted under the same id, gets its partitions
        # back at once. A new member id would wait out the old one's session (10 s) in a rebalance
        # before any `work` partition was read again. Worker ids must therefore be unique in a pool
        # (they already are: capacity adverts are keyed by them). The price: a worker that stops
        # cleanly does not leave the group either, so its partitions move after the session timeout.
        return Consumer(kafka_clients.consumer_config(
            f"gpu-{self.model_name}", self.worker_id,
            **{"max.poll.interval.ms": 300000, "group.instance.id": self.worker_id,
               "on_commit": self.on_commit}))

    def subscribe(self) -> None:
        self.group.subscribe()

    # --- rebalances ---
    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Reading starts exactly at the committed offsets, given explicitly. Left to librdkafka, a
        # partition that came back to a worker that had owned it before was seen to resume past them,
        # where this worker had fetched to when the partition left (so a request that another worker
        # was running when it died was never delivered again). Requests past the committed position that
        # a previous owner already finished are listed in the commit's metadata: skip them rather than
        # run (and bill) them again.
        committed = self.read_committed(consumer, partitions)
        if committed is None:  # librdkafka then starts each partition where it sees fit
            log.error("assigned work partitions %s without their committed offsets; librdkafka places them",
                      [p.partition for p in partitions])
        else:
            log.info("assigned work partitions %s at committed offsets %s", [p.partition for p in partitions],
                     {tp.partition: tp.offset for tp in committed})
            for tp in committed:
                if tp.offset >= 0:
                    self.offsets.adopt(tp.partition, tp.offset, tp.metadata)
            self.recorded_usage.assigned(tp.partition for tp in committed)
            consumer.incremental_assign([TopicPartition(tp.topic, tp.partition, tp.offset) for tp in committed])
        self.assigned = True
        self.numbers = {p.partition for p in consumer.assignment()} | {p.partition for p in partitions}
        self.on_assigned()

    @staticmethod
    def read_committed(consumer: Consumer, partitions: list[TopicPartition]) -> list[TopicPartition] | None:
        for attempt in range(COMMITTED_READ_ATTEMPTS):
            # Retried: the fallback is librdkafka's own placement, the one seen to skip a dead
            # worker's request; a coordinator slow to answer (a loaded machine, a rebalance of another
            # group on the same broker) must not send us there on its first timeout.
            try:
                return consumer.committed(partitions, timeout=10)
            except Exception as exc:
                log.warning("assigned work partitions %s; could not read their committed offsets "
                            "(attempt %d of %d): %s", [p.partition for p in partitions], attempt + 1,
                            COMMITTED_READ_ATTEMPTS, exc)
        return None

    def on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.give_up(partitions, commit=True)

    def on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The session lapsed (the broker was away): the group has moved on, so a commit could only
        # fail, and waiting for it would stall generation for everyone else.
        self.give_up(partitions, commit=False)

    def give_up(self, partitions: list[TopicPartition], commit: bool) -> None:
        revoked = {p.partition for p in partitions}
        log.info("%s work partitions %s", "revoked" if commit else "lost", sorted(revoked))
        self.take_down(revoked)  # another worker will get these requests again: not billed here
        if commit:
            # A clean hand-over: what ended here is committed, not run again by the next owner,
            # once its last events are delivered (their delivery reports mark it done).
            self.producer.flush(REVOKE_FLUSH_S)
            self.commit(force=True)
        for partition in revoked:
            self.offsets.forget(partition)
            self.recorded_usage.forget(partition)
        self.numbers -= revoked
        if self.assigned:
            self.announce()  # streams must stop addressing requests to the partitions it lost

    def heal(self, room: int) -> None:
        """With room for more, a stuck `work` client is replaced, keeping what runs; a full engine
        fetches nothing on purpose."""
        if self.group.heal(expect_fetching=room > 0 and self.assigned):
            self.numbers = set()  # until the new client's assignment arrives

    # --- commits ---
    def commit(self, force: bool = False, wait: bool = False) -> None:
        """Commit what finished. Asynchronous on the serving path: a synchronous commit waits for the
        group coordinator, for ten seconds or more after a broker restart, with every sequence stalled.
        A request whose last events were just delivered is committed at once (`settlements.due`), to
        narrow the window in which a crash would run it again."""
        if not (force or self.settlements.due) and time.monotonic() - self._last_commit < COMMIT_INTERVAL_S:
            return
        self.settlements.due = False
        self._last_commit = time.monotonic()
        moved = self.offsets.committable()
        if not moved:
            return
        self._committing.update(moved)
        self.offsets.mark_committed(moved)
        # one line per commit: where a request was last seen when a takeover starts past it (issue 31's lost request)
        log.info("committing work positions %s", {p: o for p, (o, _meta) in sorted(moved.items())})
        offsets = [TopicPartition(topics.WORK.name, p, o, metadata=meta) for p, (o, meta) in moved.items()]
        try:
            if wait:
                self.consumer.commit(offsets=offsets, asynchronous=False)
            else:
                self.consumer.commit(offsets=offsets, asynchronous=True)
        except Exception as exc:  # e.g. during a rebalance; offered again at the next commit
            log.warning("offset commit failed: %s", exc)
            for partition, position in moved.items():
                self.offsets.commit_failed(partition, position)

    def on_commit(self, err: Any, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            position = self._committing.pop(tp.partition, None)
            if position is not None and (err is not None or tp.error is not None):
                log.warning("offset commit failed: %s", err or tp.error)
                self.offsets.commit_failed(tp.partition, position)

    def close(self) -> None:
        self.group.close()
