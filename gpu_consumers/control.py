"""What stops requests on a worker before they end by themselves: a client's cancellation, the gate's
preemption (the slot handed back with what was produced so far), an ingress that went away, and the
partitions this worker gave up (their requests go to the next owner)."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from gpu_consumers.in_flight import RequestBook, request_id_of, resume_of
from gpu_consumers.metrics import WorkerMetrics
from gpu_consumers.offset_tracker import OffsetTracker
from gpu_consumers.replies import Replies
from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from infra.kafka.partition_reader import PartitionReader
from schemas import codec, topics
from schemas.records import InferenceRequested, PreemptRequested

log = logging.getLogger("tokenmill.worker")

REAP_INTERVAL_S = 0.2
# What a preempted request hands back: (record, partition, offset, tokens, started_at_ms,
# first_token_at_ms, text_chars, cached_tokens)
HandBack = tuple[InferenceRequested, int, int, list[int], Any, Any, int, int]


class Control:
    def __init__(self, worker_id: str, model_name: str, incarnation: str, engine: Any, book: RequestBook, *,
                 producer: Any, offsets: OffsetTracker, replies: Replies, readers: Any, metrics: WorkerMetrics,
                 announce: Callable[[], None]):
        self.worker_id = worker_id
        self.model_name = model_name
        self.incarnation = incarnation
        self.engine = engine
        self.book = book
        self.producer = producer
        self.offsets = offsets
        self.replies = replies
        self.readers = readers
        self.metrics = metrics
        self.announce = announce  # a capacity advert now: a preempted slot is free
        self.cancels: PartitionReader | None = None  # opened at the ends of its topics by open()
        self._last_reap = 0.0

    def open(self) -> None:
        """Follow `cancellations` and `preemptions` from their ends now."""
        probe = topic_reader.EndProbe(f"{self.worker_id}-cancels-end")

        def ends() -> dict[tuple[str, int], int]:
            return {(topic, p): end for topic in (topics.CANCELLATIONS.name, topics.PREEMPTIONS.name)
                    for p, end in probe.ends(topic, timeout=10).items()}

        try:
            starts = kafka_clients.with_retries(ends, "reading the end of `cancellations` and `preemptions`")
        finally:
            probe.close()
        # A cancellation or preemption left unfetched after a broker restart would never be acted on.
        self.cancels = PartitionReader(f"{self.worker_id}-cancels", starts)

    def poll(self) -> None:
        if self.cancels is None:
            return
        for msg in self.cancels.read(0, max_messages=100):
            event = kafka_clients.decode_or_dead_letter(self.producer, msg, self.worker_id,
                                                        expect=("RequestCancelled", "PreemptRequested"))
            if event is None:
                continue
            if event.name == "PreemptRequested":
                request = codec.record_of(event, PreemptRequested)
                if request["model"] == self.model_name:
                    self.preempt(request)
            else:
                self.cancel(event.record["request_id"])

    def reap_orphans(self) -> None:
        """Cancel running requests whose ingress went away (killed, restarted, shut down)."""
        if time.monotonic() - self._last_reap < REAP_INTERVAL_S:
            return
        self._last_reap = time.monotonic()
        for request_id, flight in list(self.book.in_flight.items()):
            if self.readers.gone(flight.record):
                log.info("cancelling %s: its ingress no longer reads %s", request_id, flight.reply_address)
                self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        flight = self.book.cancel(request_id)
        if flight is not None:
            log.info("cancelled %s (work partition %d offset %d)", request_id, flight.partition, flight.offset)
            self.engine.abort(request_id)
            self.replies.end_cancelled(flight)

    def preempt(self, request: PreemptRequested) -> None:
        """Give up a request's slot on the gate's word: stop it, and hand it back to streams with what
        it produced so far; streams queues it again and releases it (here or elsewhere) to resume.
        Its `work` offset is done only once streams has the hand-back, so a crash in between
        redelivers the request and it is regenerated from the start, identically."""
        request_id = request_id_of(request)
        back = self.stop_running(request_id) if request_id in self.book.in_flight else self.unqueue(request_id)
        if back is None:
            return
        record, partition, offset, tokens, started, first, chars, cached = back
        log.info("preempted %s after %d tokens (%s)", request_id, len(tokens), request["reason"])
        self.metrics.preempted(request["reason"])
        handed_back = codec.new_event(
            "RequestPreempted", request_id=request_id, tenant_id=record["tenant_id"], model=record["model"],
            worker_id=self.worker_id, incarnation=self.incarnation, reason=request["reason"],
            completion_token_ids=tokens, text_chars=chars, started_at_ms=started, first_token_at_ms=first,
            cached_tokens=cached)

        def on_delivery(err: Any, _msg: Any, _where: tuple[int, int] = (partition, offset)) -> None:
            if err is None:
                self.offsets.done(*_where)

        kafka_clients.produce_event(self.producer, topics.CAPACITY.name, self.worker_id, "RequestPreempted",
                                    handed_back, on_delivery=on_delivery)
        self.announce()

    def stop_running(self, request_id: str) -> HandBack | None:
        flight = self.book.in_flight[request_id]
        tokens = self.engine.output_token_ids(request_id)
        if tokens is None or flight.record["sampling"]["n"] != 1:
            # only single-choice requests are preempted; said, since streams counted on the slot
            log.info("preempt of %s ignored: %s", request_id,
                     "not single-choice" if tokens is not None else "not in the engine")
            return None
        self.engine.abort(request_id)
        del self.book.in_flight[request_id]
        return (flight.record, flight.partition, flight.offset, tokens, flight.started_at_ms,
                flight.first_token_at_ms, flight.text_chars, flight.cached_tokens)

    def unqueue(self, request_id: str) -> HandBack | None:
        waiting = next(((m, r) for m, r in self.book.pending if r["request_id"] == request_id), None)
        if waiting is None:
            log.info("preempt of %s ignored: not running or waiting here (finished, cancelled or elsewhere)",
                     request_id)
            return None
        self.book.pending.remove(waiting)
        msg, record = waiting
        resume = resume_of(record)
        return (record, msg.partition(), msg.offset(), list(resume.get("completion_token_ids") or []),
                resume.get("started_at_ms"), resume.get("first_token_at_ms"), int(resume.get("text_chars") or 0),
                int(resume.get("cached_tokens") or 0))

    def take_down(self, partitions: set[int]) -> None:
        """Stop, without billing, what came from partitions this worker no longer owns: their next
        owner gets these requests again."""
        for request_id, flight in list(self.book.in_flight.items()):
            if flight.partition in partitions:
                self.engine.abort(request_id)
                del self.book.in_flight[request_id]
        self.book.pending = [(m, r) for m, r in self.book.pending if m.partition() not in partitions]

    def abort_all(self) -> None:
        """A stopping worker's requests are not finished: their offsets stay uncommitted for another worker."""
        for request_id in list(self.book.in_flight):
            self.engine.abort(request_id)
        self.book.in_flight.clear()

    def close(self) -> None:
        if self.cancels is not None:
            self.cancels.close()
