"""One batch of `usage` messages into the ledger: decoded into rows (an undecodable or unbillable
message is dead-lettered with the reason and skipped), written to the sink (retried until it takes
them), the dead letters delivered, and only then the checkpoint. A crash anywhere before the
checkpoint lands makes Kafka redeliver the batch, and writing it again changes nothing (ledger.py)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from billing_pipeline import ledger
from billing_pipeline.ledger_sink import LedgerSink, Row
from billing_pipeline.pricing import PriceBook
from billing_pipeline.writer_stats import WriterStats
from infra.kafka import clients as kafka_clients
from schemas import codec
from schemas.records import RequestCompleted

log = logging.getLogger("tokenmill.billing.writer")

FIRST_RETRY_S = 0.2
LONGEST_RETRY_S = 5.0


class LedgerFlush:
    """`prices()` gives the price book to bill with now, `producer()` the producer of dead letters,
    `checkpoint(messages)` commits the batch's offsets."""

    def __init__(self, sink: LedgerSink, prices: Callable[[], PriceBook], producer: Callable[[], Any],
                 client_id: str, stats: WriterStats, stopped: threading.Event,
                 checkpoint: Callable[[list], None]):
        self.sink = sink
        self.prices = prices
        self.producer = producer
        self.client_id = client_id
        self.stats = stats
        self.stopped = stopped
        self.checkpoint = checkpoint

    def write(self, messages: list) -> int:
        """Write one batch and checkpoint it; the number of ledger rows written."""
        self.stats.consumed += len(messages)
        rows = self.rows_of(messages)
        self.write_until_stored(rows)
        self.deliver_dead_letters()
        self.checkpoint(messages)
        self.stats.inserted += len(rows)
        self.stats.batches += 1
        self.stats.last_batch_at_ms = int(time.time() * 1000)
        if rows:
            self.stats.lag_ms = self.stats.last_batch_at_ms - max(r[ledger.LEDGER_COLUMNS.index("event_ts")]
                                                                  for r in rows)
        return len(rows)

    def rows_of(self, messages: list) -> list[Row]:
        prices = self.prices()
        now_ms = int(time.time() * 1000)
        rows = []
        for msg in messages:
            event = kafka_clients.decode_or_dead_letter(self.producer(), msg, self.client_id,
                                                        expect=("RequestCompleted",))
            if event is None:
                self.stats.dead_lettered += 1
                continue
            try:
                usage = codec.record_of(event, RequestCompleted)
                rows.append(ledger.ledger_row(usage, prices, msg.partition(), msg.offset(), now_ms))
            except (ledger.InvalidUsage, KeyError, TypeError) as exc:
                kafka_clients.dead_letter(self.producer(), msg, self.client_id, f"unbillable: {exc}")
                self.stats.dead_lettered += 1
        return rows

    def write_until_stored(self, rows: list[Row]) -> None:
        """Retried with backoff while the writer runs: nothing is committed until the rows are stored."""
        delay = FIRST_RETRY_S
        while True:
            try:
                self.stats.buckets_refreshed += self.sink.write(rows)
                return
            except Exception as exc:
                self.stats.insert_errors += 1
                if self.stopped.is_set():
                    raise
                log.warning("ledger insert failed (%s); retrying in %.1fs, nothing committed", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, LONGEST_RETRY_S)

    def deliver_dead_letters(self) -> None:
        while self.producer().flush(10) > 0:
            log.warning("dead letters not delivered yet; waiting before commit")
            if self.stopped.is_set():
                raise RuntimeError("stopping with undelivered dead letters; offsets not committed")
