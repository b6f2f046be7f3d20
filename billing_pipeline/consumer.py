"""LedgerWriter: `usage` topic -> ClickHouse ledger, exactly once in effect.

A consumer loop in the shape of a stream processor's sink: poll a batch (usage_batches.py: up to
``batch_max`` messages or ``batch_ms`` ms), write it to the `LedgerSink` (ledger_flush.py,
ledger_sink.py), and checkpoint (ledger_checkpoint.py: commit its offsets) only after that write and
the batch's dead letters succeeded. A crash anywhere before the commit lands makes Kafka redeliver the
batch, and re-inserting it changes nothing: the ledger is a ReplacingMergeTree keyed by request_id
that is always read deduplicated (FINAL), and the bucket recompute is a pure function of the
deduplicated ledger. So: at-least-once delivery + idempotent writes = each request counted exactly once.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from billing_pipeline.ledger_checkpoint import LedgerCheckpoint
from billing_pipeline.ledger_flush import LedgerFlush
from billing_pipeline.ledger_sink import ClickHouseLedgerSink, LedgerSink
from billing_pipeline.pricing import PriceBook
from billing_pipeline.store import Store
from billing_pipeline.usage_batches import UsageBatches
from billing_pipeline.writer_stats import WriterStats
from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from infra.kafka.group_consumer import OFF_TOKEN_PATH, HealingGroupConsumer
from schemas import topics

log = logging.getLogger("tokenmill.billing.writer")

DEFAULT_GROUP = "billing-ledger"
PRICE_RELOAD_S = 2.0


class ReloadingPrices:
    """The store's price book, read again at most every PRICE_RELOAD_S (or at once after `reload()`)."""

    def __init__(self, store: Store):
        self.store = store
        self.book = PriceBook()
        self.loaded_at = 0.0

    def current(self) -> PriceBook:
        now = time.monotonic()
        if now - self.loaded_at > PRICE_RELOAD_S:
            self.book = PriceBook.load(self.store)
            self.loaded_at = now
        return self.book

    def reload(self) -> None:
        self.loaded_at = 0.0


class LedgerWriter:
    """Consumes `usage` in a consumer group and writes the ledger. ``run()`` blocks; ``start()``
    runs it in a daemon thread; ``stop()`` ends it (after the batch in hand is written)."""

    def __init__(self, store: Store, *, group_id: str = DEFAULT_GROUP, topic: str = topics.USAGE.name,
                 batch_max: int = 5000, batch_ms: int = 200, client_id: str | None = None,
                 consumer_overrides: dict | None = None, sink: LedgerSink | None = None):
        self.store = store
        self.topic = topic
        self.group_id = group_id
        self.client_id = client_id or f"billing-{uuid.uuid4().hex[:8]}"
        self.stats = WriterStats()
        self.prices = ReloadingPrices(store)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._producer: Producer | None = None
        self._consumer_overrides = dict(consumer_overrides or {})
        self._usage: HealingGroupConsumer | None = None
        self._ends = topic_reader.EndProbe(f"{self.client_id}-ends")  # not the fetching consumer: see EndProbe
        self.batches = UsageBatches(lambda: self.consumer, batch_max, batch_ms, self._stop)
        self.checkpoint = LedgerCheckpoint(lambda: self.consumer, self.stats)
        self.flush = LedgerFlush(sink or ClickHouseLedgerSink(store), self.prices.current, lambda: self._producer,
                                 self.client_id, self.stats, self._stop, self.commit)

    # --- lifecycle --------------------------------------------------------------------
    def open(self) -> None:
        if self._usage is not None:
            return
        cfg = kafka_clients.consumer_config(self.group_id, self.client_id, on_commit=self.checkpoint.on_commit,
                                            **self._consumer_overrides)
        # A writer may share `usage` with more writers than it has partitions: having none until its
        # first assignment is not being stuck.
        self._usage = HealingGroupConsumer(self.topic, lambda: Consumer(cfg), "ledger consumer", OFF_TOKEN_PATH,
                                           on_revoke=self.batches.on_revoke, rejoin_if_never_assigned=False)
        self._usage.subscribe()
        self._producer = Producer(kafka_clients.producer_config(self.client_id))

    @property
    def consumer(self) -> Consumer:
        """The current `usage` client (a fresh one after healing); open() first."""
        if self._usage is None:
            raise RuntimeError("the ledger writer is not open")
        return self._usage.client

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
    def poll_batch(self) -> list:
        return self.batches.poll()

    def step(self) -> int:
        """Poll one batch and write it; return the number of ledger rows written."""
        self.open()
        messages = self.poll_batch()
        if self._usage is not None:
            self._usage.heal()
        if not messages:
            self.checkpoint.commit_past_markers()
            return 0
        return self.write(messages)

    def write(self, messages: list) -> int:
        """Write one batch to the sink, then checkpoint it; the number of ledger rows written."""
        return self.flush.write(messages)

    def commit(self, messages: list) -> None:
        """The checkpoint after a flush: commit the batch's offsets."""
        self.checkpoint.commit_batch(messages)

    def reload_prices(self) -> None:
        self.prices.reload()

    # --- helpers for tests and the bench -----------------------------------------------------
    def caught_up(self) -> bool:
        """True when this group's committed offsets reach the end of every partition of the topic."""
        self.open()
        try:
            bounds = self._ends.bounds(self.topic, timeout=10)
            parts = [TopicPartition(self.topic, p) for p in bounds]
            committed = {tp.partition: tp.offset for tp in self.consumer.committed(parts, timeout=10)}
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
            self.checkpoint.commit_past_markers()
            if self.caught_up():
                return total
        raise TimeoutError(f"ledger writer not caught up after {timeout}s ({total} rows written)")
