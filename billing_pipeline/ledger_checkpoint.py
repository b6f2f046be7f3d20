"""The ledger writer's checkpoint: the `usage` offsets it commits, only after the batch they end was
flushed to the ledger.

The commit is asynchronous: a synchronous one can block its caller for good after a broker restart
(it waited on a lost coordinator for minutes, with the ledger stopped, in a fresh clone's
test_faults_broker_restart; confluent-kafka-python issue 1801 reports the same hang), while an
unanswered asynchronous one only leaves that batch to be re-read, which the ledger absorbs.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from confluent_kafka import KafkaException, TopicPartition

from billing_pipeline.writer_stats import WriterStats

log = logging.getLogger("tokenmill.billing.writer")


class LedgerCheckpoint:
    """`consumer()` gives the current group client; `stats.commits` counts the commits the broker confirmed."""

    def __init__(self, consumer: Callable[[], Any], stats: WriterStats):
        self.consumer = consumer
        self.stats = stats
        self.positions: dict[int, int] = {}  # partition -> the offset this writer last committed

    def commit_batch(self, messages: list) -> None:
        """Commit, per partition, the offset after the last message of the batch."""
        ends: dict[tuple[str, int], int] = {}
        for msg in messages:
            key = (msg.topic(), msg.partition())
            ends[key] = max(ends.get(key, -1), msg.offset() + 1)
        self.commit_offsets([TopicPartition(t, p, o) for (t, p), o in ends.items()])

    def commit_offsets(self, offsets: list[TopicPartition]) -> None:
        """Send the commit; its answer comes to `on_commit` while the writer polls."""
        try:
            self.consumer().commit(offsets=offsets, asynchronous=True)
        except KafkaException as exc:
            # e.g. the partitions were revoked meanwhile: the next owner re-reads; the ledger is idempotent.
            log.warning("offset commit failed (%s); the batch will be re-read and deduplicated", exc)
            return
        # taken as committed until an answer says otherwise, so an idle writer does not send it again
        self.positions.update((tp.partition, tp.offset) for tp in offsets)

    def on_commit(self, err: Any, partitions: list[TopicPartition]) -> None:
        failed = [tp for tp in partitions if err is not None or tp.error is not None]
        if not failed:
            self.stats.commits += 1
            return
        log.warning("offset commit failed (%s); the batch will be re-read and deduplicated",
                    err or failed[0].error)
        for tp in failed:
            if self.positions.get(tp.partition) == tp.offset:
                del self.positions[tp.partition]  # an idle writer offers this position again

    def commit_past_markers(self) -> None:
        """When idle, commit any position that moved past the last committed offset without a
        record: the streams gate writes `usage` in transactions, and a transaction's commit marker
        takes an offset no record is delivered at. Committing only after delivered records would
        leave every such partition one behind its end for good (a lag of 1 on /health, and a drain
        that never sees itself caught up). Safe because nothing is in hand: each batch delivered
        was written and committed before this poll came back empty."""
        consumer = self.consumer()
        try:
            positions = consumer.position(consumer.assignment())
        except KafkaException as exc:
            log.debug("positions unavailable: %s", exc)
            return
        moved = [tp for tp in positions
                 if tp.offset >= 0 and tp.offset > self.positions.get(tp.partition, -1)]
        if moved:
            self.commit_offsets([TopicPartition(tp.topic, tp.partition, tp.offset) for tp in moved])
