"""The ledger writer's batches of `usage` messages: up to `batch_max` messages or `batch_ms` after the
first, whichever comes first; an idle poll returns none at once, so its caller can look at its stop flag."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from confluent_kafka import TopicPartition

from infra.kafka.consume import take_available

IDLE_POLL_S = 0.1


class UsageBatches:
    def __init__(self, consumer: Callable[[], Any], batch_max: int, batch_ms: int, stopped: threading.Event):
        self.consumer = consumer
        self.batch_max = batch_max
        self.batch_ms = batch_ms
        self.stopped = stopped
        self.revoked: set[int] = set()

    def on_revoke(self, _consumer: Any, partitions: list[TopicPartition]) -> None:
        # Messages of revoked partitions that are still in hand are dropped uncommitted: their
        # new owner reads them again, and writing them twice would be harmless anyway.
        self.revoked.update(p.partition for p in partitions)

    def poll(self) -> list:
        messages: list = []
        deadline = None
        while not self.stopped.is_set() and len(messages) < self.batch_max:
            timeout = IDLE_POLL_S if deadline is None else max(0.0, deadline - time.monotonic())
            taken = take_available(self.consumer(), timeout, self.batch_max - len(messages))
            if self.revoked:
                messages = [m for m in messages if m.partition() not in self.revoked]
                self.revoked.clear()
            messages += taken.records
            if messages and deadline is None:
                deadline = time.monotonic() + self.batch_ms / 1000
            if deadline is None and not taken.records:
                break  # idle: let the caller look at the stop flag
            if deadline is not None and time.monotonic() >= deadline:
                break
        return messages
