"""The ledger writer's counters, as /health and /metrics show them."""
from __future__ import annotations

from dataclasses import dataclass


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
