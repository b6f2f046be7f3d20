"""A GPU worker: adapts the engine to Kafka.

Consumes `work` (one consumer group per model), feeds the engine, and after every engine step sends
one `ReplyBatch` per reply address, one `RequestCompleted` per finished request, and capacity
credits. Offsets are committed only once a request has ended and its last events are delivered, so a
crashed worker's requests are redelivered and regenerated.

Each job is one part, composed here: `work` membership and commits (work_partitions.py), what to
fetch before a step (work_fetch.py), decoding and admission into the engine (intake.py), the step and
its replies (engine_step.py, replies.py), cancels, preemptions and give-ups (control.py), capacity
adverts (adverts.py) and the stall watch (stall_watch.py). They share one RequestBook (in_flight.py).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid

from gpu_consumers.adapter_cache import AdapterCache
from gpu_consumers.adverts import Adverts
from gpu_consumers.after_delivery import OffsetSettlements
from gpu_consumers.control import Control
from gpu_consumers.engine import Engine
from gpu_consumers.engine_step import EngineStep
from gpu_consumers.grammar_constraints import GrammarConstraints
from gpu_consumers.in_flight import RequestBook
from gpu_consumers.intake import Intake
from gpu_consumers.metrics import WorkerMetrics
from gpu_consumers.offset_tracker import OffsetTracker
from gpu_consumers.recorded_usage import RecordedUsage
from gpu_consumers.refill_window import RefillWindow
from gpu_consumers.replies import Replies
from gpu_consumers.reply_readers import ReplyReaders
from gpu_consumers.stall_watch import StallWatch
from gpu_consumers.work_fetch import WorkFetch
from gpu_consumers.work_partitions import WorkPartitions
from infra.kafka import clients as kafka_clients
from infra.kafka.resilient_producer import ResilientProducer

log = logging.getLogger("tokenmill.worker")

# Idle but for requests whose grammars compile: the pause before looking at them again.
GRAMMAR_WAIT_S = 0.005


class GpuWorker:
    def __init__(self, engine: Engine, model_name: str, worker_id: str | None = None, metrics_port: int | None = None,
                 refill_window: RefillWindow | None = None):
        self.engine = engine
        self.model_name = model_name
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = WorkerMetrics(self.worker_id, model_name)
        if metrics_port:
            self.metrics.serve(metrics_port)
        self.incarnation = uuid.uuid4().hex[:12]
        self.producer = ResilientProducer(kafka_clients.producer_config(self.worker_id))
        self.book = RequestBook()
        self.offsets = OffsetTracker()
        self.settlements = OffsetSettlements(self.offsets)
        self.recorded_usage = RecordedUsage()
        self.readers = ReplyReaders(self.worker_id)
        # The tenants' LoRA adapters, followed from `adapters` and written to disk on first need (started by run)
        self.adapters = AdapterCache(self.worker_id)
        self.constraints = GrammarConstraints(engine)
        # The parts below call each other only through these callbacks, which run once `work` is subscribed.
        self.partitions = WorkPartitions(model_name, self.worker_id, self.producer, self.settlements,
                                         self.recorded_usage, take_down=lambda lost: self.control.take_down(lost),
                                         on_assigned=lambda: self.adverts.assigned(),
                                         announce=lambda: self.adverts.advertise(force=True))
        self.replies = Replies(self.producer, self.worker_id, self.metrics, self.recorded_usage,
                               self.settlements.settle)
        self.intake = Intake(model_name, self.worker_id, engine, self.book, producer=self.producer,
                             offsets=self.offsets, recorded_usage=self.recorded_usage, readers=self.readers,
                             constraints=self.constraints, adapters=self.adapters, replies=self.replies,
                             metrics=self.metrics)
        self.adverts = Adverts(self.worker_id, self.incarnation, model_name, engine, self.book,
                               producer=self.producer, metrics=self.metrics, adapters=self.adapters,
                               partitions=self.partitions, intake=self.intake)
        self.control = Control(self.worker_id, model_name, self.incarnation, engine, self.book,
                               producer=self.producer, offsets=self.offsets, replies=self.replies,
                               readers=self.readers, metrics=self.metrics,
                               announce=lambda: self.adverts.advertise(force=True))
        self.fetch = WorkFetch(self.partitions, self.producer, self.partitions.commit,
                               refill_window or RefillWindow())
        self.steps = EngineStep(engine, self.book, self.replies, self.metrics, self.worker_id)
        self.stall_watch = StallWatch()
        self.stopping = False

    def warm_grammars(self) -> None:
        """Start making the grammar compiler off the step loop (grammar_constraints.py)."""
        self.constraints.warm()

    def run(self) -> None:
        self.stall_watch.start()
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        self.adapters.start()
        self.partitions.subscribe()
        self.control.open()
        log.info("worker %s serving %s", self.worker_id, self.model_name)
        try:
            while not self.stopping:
                self.turn()
        finally:
            self.shutdown()

    def turn(self) -> None:
        """One turn of the loop: control events, new work, one engine step, deliveries, commits, adverts."""
        self.stall_watch.turn()
        self.control.poll()
        self.control.reap_orphans()
        busy = self.engine.has_unfinished_requests()
        room = self.engine.num_free_slots() - len(self.book.pending)
        if room > 0:
            for msg in self.fetch.take(room, busy, len(self.book.pending)):
                if msg.error():
                    continue
                self.intake.take(msg)
        if self.book.pending:
            self.intake.start_pending()
        if self.engine.has_unfinished_requests():
            self.fetch.stepped(self.steps.step(), self.steps.last_step_s)
        elif self.book.pending:
            time.sleep(GRAMMAR_WAIT_S)  # what waits is compiling its grammar: do not spin against it
        self.producer.poll(0)
        self.partitions.commit()
        self.partitions.heal(self.engine.num_free_slots() - len(self.book.pending))
        self.adverts.advertise()

    def stop(self) -> None:
        self.stopping = True
        self.stall_watch.stop()

    def shutdown(self) -> None:
        # In-flight requests are not finished: leave their offsets uncommitted for another worker.
        self.control.abort_all()
        self.adverts.advertise(force=True, stopping=True)
        self.partitions.assigned = False  # nothing advertised after the stopping advert (closing revokes partitions)
        self.producer.flush(10)  # first: the delivery reports mark what ended as done (after_delivery.py)
        self.partitions.commit(force=True, wait=True)
        self.partitions.close()
        self.control.close()
        self.readers.close()
        self.adapters.stop()
