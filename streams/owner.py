"""The active instance's loop: Kafka in, gate, Kafka out, table.

Only the instance that holds the scheduler partition runs this (see app.py). It reads
every partition of `requests`, `usage`, `cancellations`, `capacity` and `tenants`
itself (confluent-kafka, assigned directly, positions kept in the state table, so
there is no consumer-group hop and fetches return within milliseconds), and runs the
gate single-threaded on the Faust event loop.

One iteration::

    wait for input (at most one tick) -> gate.handle(each event) -> gate.step(now)
    -> produce the outputs and the dirty table entries -> commit them as one transaction

Outputs and the state that follows from them are one Kafka transaction
(owner_transaction.py), so after a crash both are there or neither is, and an owner that
stalled while another took over cannot commit anything more (it is fenced). A release that
was committed but whose delivery the state does not record yet is found on takeover:
`work` is scanned from the last confirmed release onwards and every request found there
counts as released (reconcile.py).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, cast

import httpx
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from infra.kafka.consume import close_in_background, take_available
from infra.kafka.fetch_watch import FetchWatch
from schemas import checks, topics
from streams import reconcile, state_store
from streams.config import StreamsSettings
from streams.gate import Gate
from streams.gate_outputs import Output
from streams.owner_transaction import Fenced, OwnerTransaction

log = logging.getLogger("tokenmill.streams.owner")

TICK_S = 0.05
EXPECT = {
    "requests": ("InferenceRequested",),
    "usage": ("RequestCompleted",),
    "cancellations": ("RequestCancelled",),
    "capacity": ("CapacityAdvertised", "RequestPreempted"),
    "tenants": ("TenantSnapshot",),
}


def as_producer(transaction: OwnerTransaction) -> Producer:
    """The transaction as the Kafka helpers take a producer: it produces and polls as one does
    (owner_transaction.py), committing what it produced as one transaction."""
    return cast(Producer, transaction)


def open_transaction(settings: StreamsSettings) -> OwnerTransaction:
    """Take the gate's transactional id over (fencing any previous owner). Blocking: call it
    before reading the state, whose last records a fenced owner's open transaction would hold back."""
    return OwnerTransaction(kafka_clients.producer_config(f"{settings.app_id}-owner", **{"linger.ms": 0}),
                            settings.transactional_id)


class OwnerLoop:
    def __init__(self, settings: StreamsSettings, state: dict[str, Any], metrics=None,
                 transaction: OwnerTransaction | None = None, on_fenced=None) -> None:
        self.settings = settings
        self.gate = Gate(settings, state, metrics)
        self.metrics = metrics
        # When the loop last completed an iteration (monotonic); the watchdog's sign of life.
        self.last_iteration_at: float | None = None
        self._transaction = transaction
        # Called (on the event loop) once this owner finds it was fenced out by another.
        self._on_fenced = on_fenced
        self.kinds = settings.input_topics()
        self._inbox: deque = deque()
        self._wake = asyncio.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task | None = None
        self._consumer: Consumer | None = None
        self._producer: OwnerTransaction | None = None
        self._delivered: deque = deque()

    # ---------------------------------------------------------------- start/stop

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._transaction is None:
            self._transaction = await asyncio.to_thread(open_transaction, self.settings)
        self._producer = self._transaction
        self._dead_letters = kafka_clients.DeadLetters(self.settings.app_id, as_producer(self._producer))
        await asyncio.to_thread(self._catch_up_tenants_and_reconcile)
        self._flush_state()  # the reconcile's findings, before anything new happens
        if not await asyncio.to_thread(self._producer.commit, 30):
            raise TimeoutError("the takeover's state could not be committed")
        self.last_iteration_at = time.monotonic()
        self._initial_assignment = self._assignment()
        self._next_offsets = {(tp.topic, tp.partition): tp.offset for tp in self._initial_assignment
                              if tp.offset >= 0}
        self._fetch_watch = FetchWatch(kafka_clients.bootstrap_servers())
        self._consumer = self._input_consumer()
        self._thread = threading.Thread(target=self._poll, args=(loop,), name="streams-input", daemon=True)
        self._thread.start()
        self._task = asyncio.create_task(self._run())
        self._budget_task = asyncio.create_task(self._budget_feedback())
        log.warning("scheduler active: %d queued, %d released in flight", len(self.gate.records),
                 len(self.gate.released))

    async def _budget_feedback(self) -> None:
        """Every settings.budget_poll_s, fold the ledger's month-to-date tokens into the monthly budgets."""
        from infra.config import admin_token, billing_url

        url = f"{billing_url()}/admin/usage/month-to-date"
        headers = {"Authorization": f"Bearer {admin_token()}"}
        async with httpx.AsyncClient(timeout=10) as client:
            while not self._stop.is_set():
                try:
                    resp = await client.get(url, headers=headers)
                    resp.raise_for_status()
                    now = time.time()
                    for tenant_id, usage in resp.json().items():
                        self.gate.apply_ledger_month(tenant_id, int(usage["tokens"]), now)
                    self._wake.set()
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    log.info("month-to-date from billing unavailable: %s", exc)
                await asyncio.sleep(self.settings.budget_poll_s)

    async def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if getattr(self, "_budget_task", None) is not None:
            self._budget_task.cancel()
        if self._task is not None:
            try:
                await self._task
            except Exception:  # already logged by _run
                pass
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5)
        if self._consumer is not None:
            self._consumer.close()
        if self._producer is not None:
            await asyncio.to_thread(self._producer.close, 10)
        log.info("scheduler stopped")

    def _catch_up_tenants_and_reconcile(self) -> None:
        tenants_topic = self.settings.topic(topics.TENANTS)
        # Tenants are re-read from the start on every takeover; the gate keeps no copy. The end is
        # taken first and the input consumer starts there, so a snapshot written meanwhile is read once.
        self._tenants_end = topic_reader.end_offsets(tenants_topic)
        for key, record in reconcile.read_to_end(tenants_topic, None, expect=("TenantSnapshot",),
                                                 ends=self._tenants_end):
            self.gate.handle("tenants", key, record, time.time())
        work_topic = self.settings.topic(topics.WORK)
        if self.gate.workpos:
            start = {int(p): o for p, o in self.gate.workpos.items()}
        else:
            start = topic_reader.end_offsets(work_topic)
            self.gate.begin_work_positions(start)
        found = [key.decode() for key, _ in reconcile.read_to_end(work_topic, start, expect=None) if key]
        if found:
            fixed = self.gate.mark_in_work(found, time.time())
            log.warning("takeover: %d releases after the last confirmed one, %d were still queued", len(found), fixed)

    def _input_consumer(self) -> Consumer:
        consumer = Consumer(kafka_clients.consumer_config(
            None, f"{self.settings.app_id}-owner", **{"fetch.error.backoff.ms": 10, "enable.partition.eof": True}))
        consumer.assign([TopicPartition(tp.topic, tp.partition, self._next_offsets.get((tp.topic, tp.partition),
                                                                                         tp.offset))
                         for tp in self._initial_assignment])
        return consumer

    def _replace_consumer_if_stalled(self) -> None:
        stuck = self._fetch_watch.stalled(self._next_offsets)
        if not stuck:
            return
        log.warning("input partitions %s have records but are not fetched; reading them with a new client",
                    stuck)
        old, self._consumer = self._consumer, self._input_consumer()
        close_in_background(old, "input consumer")
        self._fetch_watch.reset()

    def _assignment(self) -> list[TopicPartition]:
        assignment = []
        for topic, kind in self.kinds.items():
            if kind == "tenants":
                assignment += [TopicPartition(topic, p, o) for p, o in self._tenants_end.items()]
                continue
            parts = topic_reader.partitions(topic)
            missing = [p for p in parts if f"{topic}:{p}" not in self.gate.positions]
            # No position of ours yet (first start): continue where the previous streams
            # version's consumer group stopped, else from the beginning.
            legacy = reconcile.committed(self.settings.topic_prefix + self.settings.app_id, topic, missing)
            for p in parts:
                pos = self.gate.positions.get(f"{topic}:{p}", legacy.get(p))
                assignment.append(TopicPartition(topic, p, OFFSET_BEGINNING if pos is None else pos))
        return assignment

    # ---------------------------------------------------------------- input thread

    def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.is_set():
            try:
                taken = take_available(self._consumer, 0.05, 500)
            except Exception:  # pragma: no cover - consumer closed under us
                log.exception("input poll failed")
                time.sleep(0.1)
                continue
            self._next_offsets.update(taken.ends)  # at the end, whatever compaction removed below it
            good = taken.records
            for msg in good:
                self._next_offsets[(msg.topic(), msg.partition())] = msg.offset() + 1
            self._replace_consumer_if_stalled()
            if good:
                if self.settings.trace:
                    polled = time.time()
                    for m in good:
                        log.warning("trace consume lag %.1f ms", polled * 1000 - m.timestamp()[1])
                self._inbox.append(good)
                loop.call_soon_threadsafe(self._wake.set)

    # ---------------------------------------------------------------- main loop

    async def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    await asyncio.wait_for(self._wake.wait(), TICK_S)
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()
                if self._stop.is_set():
                    break
                await self._iteration(time.time())
        except Fenced as exc:
            # Another instance took over while this one stalled: nothing this one produced since
            # is visible to anyone. It must not decide anything more.
            log.error("fenced out by another owner (%s); giving up the scheduler", exc)
            self._stop.set()
            if self._on_fenced is not None:
                self._on_fenced()
        except Exception:
            log.exception("scheduler loop failed")
            raise

    async def _iteration(self, t_wake: float) -> None:
        gate = self.gate
        now = time.time()
        while self._inbox:
            for msg in self._inbox.popleft():
                topic = msg.topic()
                kind = self.kinds.get(topic)
                if kind is not None:
                    event = self._decode(msg, kind)
                    if event is not None or (kind == "tenants" and msg.value() is None):
                        try:
                            gate.handle(kind, msg.key(), event.record if event else None, now,
                                        event.name if event else None)
                        except Exception as exc:  # one record the gate cannot take must not stop the queue
                            log.exception("cannot process %s record", kind)
                            self._dead_letters.unprocessable(msg, exc)
                    if kind != "tenants":
                        gate.note_position(topic, msg.partition(), msg.offset())
        gate.step(now)
        outputs = gate.take_outputs()
        if self.settings.trace and outputs:
            log.warning("trace iteration start lag %.1f ms, step done %.1f ms", (now - t_wake) * 1000,
                        (time.time() - now) * 1000)
        for out in outputs:
            self._produce(out)
        self._flush_state()
        producer = self._started_transaction()
        if len(producer):
            # Bounded so the loop stays responsive; what is not committed stays in the open
            # transaction, and the next iteration's commit takes it along.
            if not await asyncio.to_thread(producer.commit, 5):
                log.error("%d records not committed yet", len(producer))
                return
            producer.poll(0)  # serve the delivery reports of what was just committed
            while self._delivered:
                gate.on_work_delivered(*self._delivered.popleft())
        self.last_iteration_at = time.monotonic()
        if self.metrics is not None:
            try:
                self.metrics.observe_gate(gate, now)
            except Exception:  # metrics are for people; the queue goes on without them
                log.exception("refreshing the queue metrics failed")

    def _decode(self, msg, kind: str):
        if msg.value() is None and kind == "tenants":
            return None  # a tombstone: the tenant was deleted
        # Every input, capacity and tenants included: park it with the reason and go on (a
        # tenant keeps its last good snapshot, a worker its last good advert).
        event = self._dead_letters.decode(msg, EXPECT[kind])
        if event is None:
            return None
        if kind == "tenants":
            problem = checks.tenant_key_problem(event.record, msg.key())
            if problem:
                self._dead_letters.send(msg, problem)
                return None
        return event

    def _produce(self, out: Output) -> None:
        on_delivery: Callable[[Any, Any], None] | None
        if out.release_of is not None:
            def on_delivery(err, msg, _rid=out.release_of):
                if err is None:
                    self._delivered.append((msg.partition(), msg.offset()))
                elif err.code() not in (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT):
                    # Not lost: its transaction cannot commit without it, and is sent again whole.
                    log.warning("release of %s not delivered (%s); its transaction goes again", _rid, err)
        else:
            on_delivery = None
        # produce_event encodes any event's record: the typed one is a dict of that event's fields.
        kafka_clients.produce_event(as_producer(self._started_transaction()), out.topic, out.key, out.event,
                                    cast(dict[str, Any], out.record), partition=out.partition,
                                    on_delivery=on_delivery)

    def _flush_state(self) -> None:
        dirty = self.gate.take_dirty()
        if dirty:
            state_store.write(as_producer(self._started_transaction()), self.settings.state_topic, dirty)

    def _started_transaction(self) -> OwnerTransaction:
        assert self._producer is not None, "the loop runs only once start() opened the transaction"
        return self._producer
