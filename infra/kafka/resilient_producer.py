"""A producer that replaces its librdkafka client when deliveries stall while the broker answers.

After a broker restart, librdkafka can leave a partition without a usable leader for good: a
produce or fetch response that names leader -1 while the broker is still starting is skipped
("Partition ...: new leader-1 not found in cache"), and records for that partition then wait in
the client's queue until `message.timeout.ms` (librdkafka issue 5430, open; seen here on
`requests` and `replies` about once in five restarts under load: the platform stopped serving).
A fresh client reads fresh metadata and delivers at once.

So this wrapper keeps every record until its delivery is confirmed. When records have waited
longer than ``stall_after_s`` *while the broker answered metadata requests* (an outage is waited
out: a new client could not shorten it, and records queued during one are delivered within a
second of the broker's return), it purges the old client and produces the unconfirmed records
again, in their original order, on a new one. The broker is asked through the stalled client
itself, which cannot tell its own breakage from the broker's absence (seen here: a worker's
client answered "unreachable" for a minute after the broker was back, on a machine loaded past
its cores, and the whole pool stopped advertising), so a stall longer than
``replace_anyway_after_s`` gets a new client whatever the probe says, at most once per that
period while it lasts. A record can then arrive twice
(one the old client had in flight): every topic this platform writes is idempotent by key or by
id downstream (requests and usage by request id, replies by token index, state by key).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from confluent_kafka import KafkaError, Producer

from infra.kafka import clients as kafka_clients

log = logging.getLogger(__name__)

STALL_AFTER_S = 3.0
REPLACE_ANYWAY_AFTER_S = 15.0
CHECK_EVERY_S = 1.0
_PURGED = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)


@dataclass
class _Unconfirmed:
    topic: str
    kwargs: dict[str, Any]
    on_delivery: Callable | None
    produced_at: float


class ResilientProducer:
    """The subset of confluent_kafka.Producer this project uses: produce, poll, flush, len."""

    def __init__(self, config: dict[str, Any], stall_after_s: float = STALL_AFTER_S,
                 client_factory: Callable[[dict[str, Any]], Any] = Producer,
                 replace_anyway_after_s: float = REPLACE_ANYWAY_AFTER_S):
        self._config = config
        self.stall_after_s = stall_after_s
        self.replace_anyway_after_s = replace_anyway_after_s
        self._new_client = client_factory
        self._producer = client_factory(config)
        self._retired: list[Any] = []  # replaced clients, kept so that destroying one never blocks a caller
        self._generation = 0
        self._unconfirmed: dict[int, _Unconfirmed] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._last_check = time.monotonic()
        self._next_probe = 0.0
        self._reachable_since: float | None = None
        self.replacements = 0

    def produce(self, topic: str, key=None, value=None, headers=None, partition: int | None = None,
                on_delivery: Callable | None = None) -> None:
        kwargs = kafka_clients.produce_arguments(key, value, headers, partition)
        with self._lock:
            ident = self._next_id
            self._next_id += 1
            # Registered after the client took it: a BufferError leaves nothing behind to resend.
            self._producer.produce(topic, **kwargs, on_delivery=self._callback(ident, self._generation))
            self._unconfirmed[ident] = _Unconfirmed(topic, kwargs, on_delivery, time.monotonic())

    def _callback(self, ident: int, generation: int):
        def on_delivery(err, msg):
            with self._lock:
                if err is not None and err.code() in _PURGED and generation != self._generation:
                    return  # purged from a replaced client; already produced again on the new one
                entry = self._unconfirmed.pop(ident, None)
            if entry is not None and entry.on_delivery is not None:
                entry.on_delivery(err, msg)
        return on_delivery

    def poll(self, timeout: float = 0) -> int:
        served = self._producer.poll(timeout)
        self.check()
        return served

    def flush(self, timeout: float | None = None) -> int:
        """Like Producer.flush, but a stall found meanwhile is repaired, and what the new client
        still holds at the deadline is what is returned."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            remaining = self._producer.flush(min(left, CHECK_EVERY_S) if left is not None else CHECK_EVERY_S)
            self.check()
            if remaining == 0 and not self._unconfirmed:
                return 0
            if deadline is not None and time.monotonic() >= deadline:
                return max(remaining, len(self._unconfirmed))

    def __len__(self) -> int:
        return len(self._producer)

    def check(self, now: float | None = None) -> bool:
        """Replace the client if the oldest unconfirmed record has stalled while the broker answers."""
        now = time.monotonic() if now is None else now
        if now - self._last_check < CHECK_EVERY_S:
            return False
        self._last_check = now
        with self._lock:
            if not self._unconfirmed:
                return False
            oldest = min(e.produced_at for e in self._unconfirmed.values())
        if now - oldest < self.stall_after_s or now < self._next_probe:
            return False
        if not kafka_clients.broker_answers(self._producer):
            # An outage, or a client too broken to tell: ask again soon, but not every second (the call
            # blocks the caller meanwhile), and past the hard bound replace it anyway.
            self._reachable_since = None
            self._next_probe = now + 2.0
            if now - oldest >= self.replace_anyway_after_s:
                self._replace(now - oldest, now, "and the client cannot reach the broker")
                return True
            return False
        if self._reachable_since is None:
            self._reachable_since = now  # back (or first asked): the client gets a stall period from here
        if now - max(oldest, self._reachable_since) < self.stall_after_s:
            return False
        self._replace(now - oldest, now, "while the broker answers")
        return True

    def _replace(self, stalled_s: float, now: float, why: str) -> None:
        with self._lock:
            old = self._producer
            self._generation += 1
            self._producer = self._new_client(self._config)
            entries = sorted(self._unconfirmed.items())
            log.warning("%d records unconfirmed for %.1f s %s; producing them again on a new client "
                        "(librdkafka issue 5430)", len(entries), stalled_s, why)
            for ident, entry in entries:
                self._producer.produce(entry.topic, **entry.kwargs,
                                       on_delivery=self._callback(ident, self._generation))
                entry.produced_at = now  # the new client gets a whole stall_after_s of its own
            self.replacements += 1
        old.purge(in_queue=True, in_flight=True)
        old.poll(0)  # serve the purge callbacks, which the generation check ignores
        self._retired.append(old)
