"""The owner's writes as Kafka transactions: what fences a stalled owner out.

Only one streams instance may release at a time, but group membership alone cannot promise it: an
owner that stalls (SIGSTOP, a long GC-like pause, a frozen VM) keeps believing it owns the queue
until it learns of the rebalance, while its standby has already taken over. On waking it may send
releases it decided before the stall, or decide new ones from the credits it reads on waking, for
requests the new owner has released already.

So every owner writes through one producer whose ``transactional.id`` is the gate's own (the same on
every instance). Taking over calls ``init_transactions``, which makes the broker abort whatever
transaction the previous holder left open and refuse any further write or commit from it: a woken
owner's releases are never committed, and every consumer of them (workers on `work`, ingress on
`replies`, billing on `usage`, the state follower) reads committed records only, librdkafka's
default. The owner learns it was fenced on its next commit, stops, and exits to rejoin as a
standby.

A transaction spans one loop iteration: its outputs and the state entries that follow from them,
committed together (so state and outputs can no longer disagree after a crash). A commit that fails
in a way the client can recover from is retried with the same records in a new transaction; one
that stalls while the broker answers (librdkafka issue 5430, see infra/kafka/resilient_producer.py) gets
a new client, which aborts the stuck transaction, and the records are sent again.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from confluent_kafka import KafkaError, KafkaException, Producer

from infra.kafka import clients as kafka_clients

log = logging.getLogger("tokenmill.streams.transaction")

# How long a commit may wait before the client is presumed stuck and replaced.
STALL_AFTER_S = 3.0
# An open transaction the coordinator aborts by itself when its owner stops committing (frozen
# with no standby to fence it): bounds how long readers of its partitions wait behind it.
TRANSACTION_TIMEOUT_MS = 10_000
_FENCED = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH,
           KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED}


class Fenced(Exception):
    """Another instance took the transactional id over: this one no longer owns the queue."""


@dataclass
class _Record:
    topic: str
    kwargs: dict[str, Any]
    on_delivery: Callable | None


def _error(exc: KafkaException) -> KafkaError | None:
    err = exc.args[0] if exc.args else None
    return err if isinstance(err, KafkaError) else None


class OwnerTransaction:
    """produce / poll like a Producer; ``commit`` ends the open transaction and begins the next.

    Only being fenced is final. Every other failure (an abort the broker asks for, a client that
    will not abort, a new client the coordinator is not ready for yet, as after a broker restart:
    CONCURRENT_TRANSACTIONS) leaves the records here, and a later commit sends them again whole on a
    working client. A client given up on is never used again: its successor's ``init_transactions``
    may already have fenced it, and a fence that is our own doing must not look like a new owner."""

    def __init__(self, config: dict[str, Any], transactional_id: str, init_timeout_s: float = 30.0,
                 client_factory: Callable[[dict[str, Any]], Any] = Producer, stall_after_s: float = STALL_AFTER_S):
        self._config = {**config, "transactional.id": transactional_id,
                        "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS}
        self._factory = client_factory
        self.stall_after_s = stall_after_s
        self._records: list[_Record] = []  # produced in the open transaction, kept until it commits
        self.replacements = 0
        self._client = self._open(init_timeout_s)

    def _open(self, timeout_s: float):
        """A client that holds the transactional id: the broker aborts the previous holder's open
        transaction and fences it off before this returns."""
        client = self._factory(self._config)
        try:
            client.init_transactions(timeout_s)
            client.begin_transaction()
        except KafkaException as exc:
            err = _error(exc)
            if err is not None and err.code() in _FENCED:
                raise Fenced(str(err)) from None
            raise
        return client

    def produce(self, topic: str, key=None, value=None, headers=None, partition: int | None = None,
                on_delivery: Callable | None = None) -> None:
        kwargs = kafka_clients.produce_arguments(key, value, headers, partition)
        record = _Record(topic, kwargs, on_delivery)
        self._records.append(record)
        if self._client is not None:
            try:
                self._send(record)
            except KafkaException as exc:
                self._give_up_client(f"produce failed ({exc})")

    def _send(self, record: _Record) -> None:
        while True:
            try:
                self._client.produce(record.topic, **record.kwargs, on_delivery=record.on_delivery)
                return
            except BufferError:  # the client's queue is full: let deliveries drain
                self._client.poll(0.05)
            except KafkaException as exc:
                self._raise_if_fenced(exc)
                raise

    def poll(self, timeout: float = 0) -> int:
        return self._client.poll(timeout) if self._client is not None else 0

    def __len__(self) -> int:
        return len(self._records)

    def commit(self, timeout: float) -> bool:
        """Commit what was produced since the last commit. True once committed; False when
        ``timeout`` passed first (the records stay, and the next commit tries again). Raises
        Fenced when another instance holds the transactional id now."""
        if not self._records and self._client is not None:
            return True
        deadline = time.monotonic() + timeout
        stalled_since = time.monotonic()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._client is None:
                if not self._reopen(min(left, 5.0)):
                    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                    continue
                stalled_since = time.monotonic()
            try:
                self._client.commit_transaction(min(left, self.stall_after_s))
            except KafkaException as exc:
                self._raise_if_fenced(exc)
                err = _error(exc)
                if err is not None and err.txn_requires_abort() and not err.fatal():
                    log.warning("transaction aborted (%s); sending its %d records again", err, len(self._records))
                    try:
                        self._client.abort_transaction(max(1.0, min(left, self.stall_after_s)))
                        self._client.begin_transaction()
                        for record in self._records:
                            self._send(record)
                    except KafkaException as again:
                        self._raise_if_fenced(again)
                        self._give_up_client(f"could not abort and begin again ({again})")
                elif (err is not None and err.fatal()) or (
                        time.monotonic() - stalled_since >= self.stall_after_s and kafka_clients.broker_answers(self._client)):
                    # Stuck while the broker is there (an outage is waited out: a new client could not
                    # shorten it) or broken for good: a new client aborts what this one left open.
                    self._give_up_client(f"commit not done after {time.monotonic() - stalled_since:.1f} s ({err})")
                continue
            self._records = []
            try:
                self._client.begin_transaction()
            except KafkaException as exc:
                self._raise_if_fenced(exc)
                self._give_up_client(f"could not begin the next transaction ({exc})")
            return True

    def _give_up_client(self, why: str) -> None:
        log.warning("%s; the next commit starts a new client, which aborts what this one left open, "
                    "and sends its %d records again", why, len(self._records))
        old, self._client = self._client, None
        if old is not None:
            old.purge(in_queue=True, in_flight=True)

    def _reopen(self, timeout_s: float) -> bool:
        try:
            client = self._open(timeout_s)
        except KafkaException as exc:  # e.g. CONCURRENT_TRANSACTIONS while the coordinator ends the old one
            log.warning("a new transactional client could not start yet: %s", exc)
            return False
        self._client = client
        self.replacements += 1
        try:
            for record in self._records:
                self._send(record)
        except KafkaException as exc:
            self._give_up_client(f"sending again failed ({exc})")
            return False
        return True

    @staticmethod
    def _raise_if_fenced(exc: KafkaException) -> None:
        err = _error(exc)
        if err is not None and err.code() in _FENCED:
            raise Fenced(str(err)) from None

    def close(self, timeout: float = 5.0) -> None:
        """Commit what is open (best effort) and let the client go."""
        try:
            self.commit(timeout)
        except Fenced:
            pass
        if self._client is not None:
            self._client.flush(1)
