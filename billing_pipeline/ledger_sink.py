"""Where the ledger writer puts a batch of ledger rows: `write(rows)` returns once they are stored
(and the minute aggregate they touch recomputed), or raises; the writer commits offsets only after
it returned. ClickHouse in service, memory in unit tests."""
from __future__ import annotations

from typing import Any, Protocol

from billing_pipeline import ledger
from billing_pipeline.store import Store

Row = list[Any]


class LedgerSink(Protocol):
    def write(self, rows: list[Row]) -> int:
        """Store the rows; the number of minute buckets recomputed."""


class ClickHouseLedgerSink:
    """The ledger table (a ReplacingMergeTree read FINAL, so a row written twice counts once) and the
    minute buckets its rows fall in, recomputed from the deduplicated ledger."""

    def __init__(self, store: Store):
        self.store = store

    def write(self, rows: list[Row]) -> int:
        moved = ledger.previous_buckets(self.store, rows)
        ledger.insert_rows(self.store, rows)
        return ledger.refresh_buckets(self.store, ledger.buckets_of(rows) | moved)


class InMemoryLedgerSink:
    """The ledger as a dict of rows by request id, the last written winning, as the table read FINAL
    does (its version is the finish time). `fail_next` writes raise first, as a store away would."""

    def __init__(self, fail_next: int = 0):
        self.rows: dict[str, Row] = {}
        self.writes: list[list[Row]] = []
        self.fail_next = fail_next

    def write(self, rows: list[Row]) -> int:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("the in-memory ledger refuses this write")
        self.writes.append(list(rows))
        request_id, version = ledger.LEDGER_COLUMNS.index("request_id"), ledger.LEDGER_COLUMNS.index("version")
        for row in rows:
            kept = self.rows.get(row[request_id])
            if kept is None or kept[version] <= row[version]:
                self.rows[row[request_id]] = row
        return len(ledger.buckets_of(rows))
