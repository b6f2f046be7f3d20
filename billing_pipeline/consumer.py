"""LedgerWriter: `usage` topic -> ClickHouse ledger, exactly once in effect.

Loop: poll up to ``batch_max`` messages or ``batch_ms`` ms; decode them (an undecodable or
unbillable message is dead-lettered with the reason and skipped); insert the rows in one batch;
recompute the minute buckets the batch touched from the deduplicated ledger; wait until the
dead letters are delivered; and only then commit the offsets. A crash anywhere before the commit
lands makes Kafka redeliver the batch, and re-inserting it changes nothing: the ledger is a
ReplacingMergeTree keyed by request_id that is always read deduplicated (FINAL), and the bucket
recompute is a pure function of the deduplicated ledger. So: at-least-once delivery + idempotent
writes = each request counted exactly once.

The commit is asynchronous: a synchronous one can block its caller for good after a broker restart
(it waited on a lost coordinator for minutes, with the ledger stopped, in a fresh clone's
test_faults_broker_restart; confluent-kafka-python issue 1801 reports the same hang), while an
unanswered asynchronous one only leaves that batch to be re-read, which the ledger absorbs.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from billing_pipeline import ledger
from billing_pipeline.pricing import PriceBook
from billing_pipeline.store import Store
from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from infra.kafka.consume import take_available
from infra.kafka.group_consumer import OFF_TOKEN_PATH, HealingGroupConsumer
from schemas import codec, topics
from schemas.records import RequestCompleted

log = logging.getLogger("tokenmill.billing.writer")

DEFAULT_GROUP = "billing-ledger"
PRICE_RELOAD_S = 2.0


@dataclass
class WriterStats:
    consumed: int = 0
    inserted: int = 0
    dead_lettered: int = 0
    batches: int = 0
    commits: int = 0
    insert_errors: int = 0
    buckets_refreshed: int = 0
    last_batch_at_ms: int = 0
    lag_ms: int = 0  # now - event timestamp of the newest row of the last batch

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Batch:
    messages: list = field(default_factory=list)
    first_at: float = 0.0


class LedgerWriter:
    """Consumes `usage` in a consumer group and writes the ledger. ``run()`` blocks; ``start()``
    runs it in a daemon thread; ``stop()`` ends it (after the batch in hand is written)."""

    def __init__(self, store: Store, *, group_id: str = DEFAULT_GROUP, topic: str = topics.USAGE.name,
                 batch_max: int = 5000, batch_ms: int = 200, client_id: str | None = None,
                 consumer_overrides: dict | None = None):
        self.store = store
        self.topic = topic
        self.group_id = group_id
        self.batch_max = batch_max
        self.batch_ms = batch_ms
        self.client_id = client_id or f"billing-{uuid.uuid4().hex[:8]}"
        self.stats = WriterStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._producer: Producer | None = None
        self._prices = PriceBook()
        self._prices_loaded_at = 0.0
        self._consumer_overrides = dict(consumer_overrides or {})
        self._revoked: set[int] = set()
        self._committed: dict[int, int] = {}  # partition -> the offset this writer last committed
        self._usage: HealingGroupConsumer | None = None
        self._ends = topic_reader.EndProbe(f"{self.client_id}-ends")  # not the fetching consumer: see EndProbe
        self.error: BaseException | None = None

    # --- lifecycle --------------------------------------------------------------------
    def open(self) -> None:
        if self._consumer is not None:
            return
        self._open_consumer()
        self._producer = Producer(kafka_clients.producer_config(self.client_id))

    def _open_consumer(self) -> None:
        cfg = kafka_clients.consumer_config(self.group_id, self.client_id, on_commit=self._on_commit,
                                            **self._consumer_overrides)
        # A writer may share `usage` with more writers than it has partitions: having none until its
        # first assignment is not being stuck.
        self._usage = HealingGroupConsumer(self.topic, lambda: Consumer(cfg), "ledger consumer", OFF_TOKEN_PATH,
                                           on_revoke=self._on_revoke, rejoin_if_never_assigned=False)
        self._usage.subscribe()

    @property
    def _consumer(self) -> Consumer | None:
        return None if self._usage is None else self._usage.client

    def close(self) -> None:
        """Leave the group without committing anything more (the next owner re-reads what is
        uncommitted)."""
        if self._producer is not None:
            self._producer.flush(10)
        if self._usage is not None:
            self._usage.close()
        self._usage = None
        self._producer = None
        self._ends.close()

    def start(self) -> "LedgerWriter":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run_safely, name="ledger-writer", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run_safely(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # keep it visible on /health
            self.error = exc
            log.exception("ledger writer stopped")

    def run(self) -> None:
        self.open()
        try:
            while not self._stop.is_set():
                self.step()
        finally:
            self.close()

    # --- one batch ----------------------------------------------------------------------
    def _on_revoke(self, _consumer, partitions) -> None:
        # Messages of revoked partitions that are still in hand are dropped uncommitted: their
        # new owner reads them again, and writing them twice would be harmless anyway.
        self._revoked.update(p.partition for p in partitions)

    def poll_batch(self) -> list:
        batch = _Batch()
        deadline = None
        while not self._stop.is_set() and len(batch.messages) < self.batch_max:
            timeout = 0.1 if deadline is None else max(0.0, deadline - time.monotonic())
            taken = take_available(self._consumer, timeout, self.batch_max - len(batch.messages))
            if self._revoked:
                batch.messages = [m for m in batch.messages if m.partition() not in self._revoked]
                self._revoked.clear()
            batch.messages += taken.records
            if batch.messages and deadline is None:
                deadline = time.monotonic() + self.batch_ms / 1000
            if deadline is None and not taken.records:
                break  # idle: let the caller look at the stop flag
            if deadline is not None and time.monotonic() >= deadline:
                break
        return batch.messages

    def step(self) -> int:
        """Poll one batch and write it; return the number of ledger rows written."""
        self.open()
        messages = self.poll_batch()
        self._usage.heal()
        if not messages:
            self._commit_positions_past_markers()
            return 0
        return self.write(messages)

    def _price_book(self) -> PriceBook:
        now = time.monotonic()
        if now - self._prices_loaded_at > PRICE_RELOAD_S:
            self._prices = PriceBook.load(self.store)
            self._prices_loaded_at = now
        return self._prices

    def reload_prices(self) -> None:
        self._prices_loaded_at = 0.0

    def write(self, messages: list) -> int:
        self.stats.consumed += len(messages)
        prices = self._price_book()
        now_ms = int(time.time() * 1000)
        rows = []
        for msg in messages:
            event = kafka_clients.decode_or_dead_letter(self._producer, msg, self.client_id,
                                                        expect=("RequestCompleted",))
            if event is None:
                self.stats.dead_lettered += 1
                continue
            try:
                usage = codec.record_of(event, RequestCompleted)
                rows.append(ledger.ledger_row(usage, prices, msg.partition(), msg.offset(), now_ms))
            except (ledger.InvalidUsage, KeyError, TypeError) as exc:
                kafka_clients.dead_letter(self._producer, msg, self.client_id, f"unbillable: {exc}")
                self.stats.dead_lettered += 1
        self._insert_with_retry(rows)
        self._flush_dead_letters()
        self._commit(messages)
        self.stats.inserted += len(rows)
        self.stats.batches += 1
        self.stats.last_batch_at_ms = int(time.time() * 1000)
        if rows:
            self.stats.lag_ms = self.stats.last_batch_at_ms - max(r[ledger.LEDGER_COLUMNS.index("event_ts")]
                                                                  for r in rows)
        return len(rows)

    def _insert_with_retry(self, rows: list) -> None:
        delay = 0.2
        while True:
            try:
                moved = ledger.previous_buckets(self.store, rows)
                ledger.insert_rows(self.store, rows)
                self.stats.buckets_refreshed += ledger.refresh_buckets(self.store, ledger.buckets_of(rows) | moved)
                return
            except Exception as exc:
                self.stats.insert_errors += 1
                if self._stop.is_set():
                    raise
                log.warning("ledger insert failed (%s); retrying in %.1fs, nothing committed", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _flush_dead_letters(self) -> None:
        while self._producer.flush(10) > 0:
            log.warning("dead letters not delivered yet; waiting before commit")
            if self._stop.is_set():
                raise RuntimeError("stopping with undelivered dead letters; offsets not committed")

    def _commit(self, messages: list) -> None:
        """Commit, per partition, the offset after the last message of the batch."""
        ends: dict[tuple[str, int], int] = {}
        for msg in messages:
            key = (msg.topic(), msg.partition())
            ends[key] = max(ends.get(key, -1), msg.offset() + 1)
        self._commit_offsets([TopicPartition(t, p, o) for (t, p), o in ends.items()])

    def _commit_offsets(self, offsets: list[TopicPartition]) -> None:
        """Send the commit; its answer comes to `_on_commit` while the writer polls."""
        try:
            self._consumer.commit(offsets=offsets, asynchronous=True)
        except KafkaException as exc:
            # e.g. the partitions were revoked meanwhile: the next owner re-reads; the ledger is idempotent.
            log.warning("offset commit failed (%s); the batch will be re-read and deduplicated", exc)
            return
        # taken as committed until an answer says otherwise, so an idle writer does not send it again
        self._committed.update((tp.partition, tp.offset) for tp in offsets)

    def _on_commit(self, err, partitions) -> None:
        failed = [tp for tp in partitions if err is not None or tp.error is not None]
        if not failed:
            self.stats.commits += 1
            return
        log.warning("offset commit failed (%s); the batch will be re-read and deduplicated",
                    err or failed[0].error)
        for tp in failed:
            if self._committed.get(tp.partition) == tp.offset:
                del self._committed[tp.partition]  # an idle writer offers this position again

    def _commit_positions_past_markers(self) -> None:
        """When idle, commit any position that moved past the last committed offset without a
        record: the streams gate writes `usage` in transactions, and a transaction's commit marker
        takes an offset no record is delivered at. Committing only after delivered records would
        leave every such partition one behind its end for good (a lag of 1 on /health, and a drain
        that never sees itself caught up). Safe because nothing is in hand: each batch delivered
        was written and committed before this poll came back empty."""
        try:
            positions = self._consumer.position(self._consumer.assignment())
        except KafkaException as exc:
            log.debug("positions unavailable: %s", exc)
            return
        moved = [tp for tp in positions
                 if tp.offset >= 0 and tp.offset > self._committed.get(tp.partition, -1)]
        if moved:
            self._commit_offsets([TopicPartition(tp.topic, tp.partition, tp.offset) for tp in moved])

    # --- helpers for tests and the bench -----------------------------------------------------
    def caught_up(self) -> bool:
        """True when this group's committed offsets reach the end of every partition of the topic."""
        self.open()
        try:
            bounds = self._ends.bounds(self.topic, timeout=10)
            parts = [TopicPartition(self.topic, p) for p in bounds]
            committed = {tp.partition: tp.offset for tp in self._consumer.committed(parts, timeout=10)}
            for p, (lo, hi) in bounds.items():
                if hi > lo and committed.get(p, -1) < hi:
                    return False
        except KafkaException as exc:  # e.g. the group coordinator is still loading
            log.debug("caught_up: %s", exc)
            return False
        return True

    def drain(self, timeout: float = 60.0) -> int:
        """Write batches until every partition is read to its end (as of the last check); return rows."""
        self.open()
        total = 0
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            messages = self.poll_batch()
            if messages:
                total += self.write(messages)
                continue
            self._commit_positions_past_markers()
            if self.caught_up():
                return total
        raise TimeoutError(f"ledger writer not caught up after {timeout}s ({total} rows written)")
