"""A worker's intake: each `work` message decoded and booked as pending, then each pending request
admitted into the engine when it has room, or ended unstarted (cancelled, past its deadline, a bad
response_format, an adapter that cannot be served)."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from gpu_consumers.adapter_cache import ADAPTER_WAITING, AdapterCache, AdapterUnavailable
from gpu_consumers.engine import LoraLoadError, SamplingParams
from gpu_consumers.grammar_constraints import COMPILING, GrammarConstraints
from gpu_consumers.in_flight import InFlight, RequestBook, now_ms, request_id_of, resume_of
from gpu_consumers.metrics import WorkerMetrics
from gpu_consumers.offset_tracker import OffsetTracker
from gpu_consumers.recorded_usage import RecordedUsage
from gpu_consumers.replies import Refusal, Replies
from infra.kafka import clients as kafka_clients
from structured_outputs.grammars import GrammarBusy, GrammarError
from schemas import codec
from schemas.records import InferenceRequested, SamplingSpec

log = logging.getLogger("tokenmill.worker")


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    return SamplingParams(
        max_tokens=spec["max_tokens"], temperature=spec["temperature"], top_p=spec["top_p"],
        top_k=spec["top_k"], min_p=spec["min_p"], repetition_penalty=spec["repetition_penalty"],
        presence_penalty=spec["presence_penalty"], frequency_penalty=spec["frequency_penalty"],
        seed=spec["seed"], stop=list(spec["stop"]), stop_token_ids=list(spec["stop_token_ids"]),
        ignore_eos=spec["ignore_eos"], n=spec["n"], logprobs=spec["logprobs"],
    )


class Intake:
    def __init__(self, model_name: str, worker_id: str, engine: Any, book: RequestBook, *, producer: Any,
                 offsets: OffsetTracker, recorded_usage: RecordedUsage, readers: Any,
                 constraints: GrammarConstraints, adapters: AdapterCache, replies: Replies,
                 metrics: WorkerMetrics):
        self.model_name = model_name
        self.worker_id = worker_id
        self.engine = engine
        self.book = book
        self.producer = producer
        self.offsets = offsets
        self.recorded_usage = recorded_usage
        self.readers = readers
        self.constraints = constraints
        self.adapters = adapters
        self.replies = replies
        self.metrics = metrics
        self.consumed_total = 0  # this model's requests taken in (streams matches it against its releases)

    def take(self, msg: Any) -> None:
        """Book one `work` message: pending if it is this model's request to run, else done at once."""
        self.offsets.started(msg.partition(), msg.offset())
        if self.offsets.already_done(msg.partition(), msg.offset()):
            self.offsets.done(msg.partition(), msg.offset())
            return
        event = kafka_clients.decode_or_dead_letter(self.producer, msg, self.worker_id, expect=("InferenceRequested",))
        if event is None:
            self.offsets.done(msg.partition(), msg.offset())
            return
        record = codec.record_of(event, InferenceRequested)
        if record["model"] != self.model_name:
            self.offsets.done(msg.partition(), msg.offset())  # another model's pool serves it
            return
        self.recorded_usage.taken(msg.partition(), msg.timestamp()[1])
        # Only this model's requests count as taken in: streams matches this count against its
        # releases *for this model*. Counting other models' records (all pools read all of `work`)
        # made streams see releases as taken in that were not, and give out slots the pool did not
        # have: a new pool that first skips `work`'s history credited thousands.
        self.consumed_total += 1
        self.book.pending.append((msg, record))

    def start_pending(self) -> None:
        self.book.pending = [(msg, record) for msg, record in self.book.pending
                             if not self.started_or_ended(msg, record)]

    def started_or_ended(self, msg: Any, record: InferenceRequested) -> bool:
        """Start one decoded request, or end it unstarted; False while it must wait (no room in the
        KV cache yet, its grammar still compiling, its adapter not on disk yet)."""
        request_id = request_id_of(record)
        if self.readers.gone(record) and request_id not in self.book.cancelled:
            log.info("cancelling %s before it starts: its ingress no longer reads %s:%s", request_id,
                     record["reply_topic"], record["reply_partition"])
            self.book.cancelled[request_id] = None  # nobody would read the stream
        running = self.book.in_flight.get(request_id)
        if running is not None:
            log.warning("work record %s:%s (request %s) delivered while it runs from %s:%s",
                        msg.partition(), msg.offset(), request_id, running.partition, running.offset)
            if (running.partition, running.offset) != (msg.partition(), msg.offset()):
                self.offsets.done(msg.partition(), msg.offset())
            return True
        if request_id in self.book.cancelled:
            return self.replies.end_unstarted(record, msg.partition(), msg.offset(), "cancelled", "cancelled")
        if now_ms() >= record["deadline_ms"]:  # never start a request whose deadline has passed
            return self.replies.end_unstarted(record, msg.partition(), msg.offset(), "shed", "deadline", (
                503, "service_unavailable", "deadline_exceeded",
                "The request waited past its deadline and was not started.", 1.0))
        return self.admit(msg, record)

    def admit(self, msg: Any, record: InferenceRequested) -> bool:
        """Into the engine if it fits now and its grammar and adapter are ready; ended if either is refused."""
        request_id = request_id_of(record)
        resume = resume_of(record)
        resumed_tokens = list(resume.get("completion_token_ids") or [])
        if not self.engine.can_admit(len(record["prompt_token_ids"]) + len(resumed_tokens)):
            return False
        params = sampling_params(record["sampling"])
        try:
            params.constraint = self.constraints.for_request(record)
        except GrammarBusy as exc:  # waited too long for a compile slot: not the schema's fault
            return self.refuse(msg, record, (503, "service_unavailable", "grammar_compiler_busy", str(exc), 1.0))
        except GrammarError as exc:
            return self.refuse(msg, record, (400, "invalid_request_error", "invalid_response_format", str(exc), None))
        if params.constraint is COMPILING:
            return False  # its grammar compiles off the step loop
        try:
            lora = self.adapters.lora_for(record)
        except AdapterUnavailable as exc:  # deleted before it started, or its files never arrived whole
            self.adapters.forget(request_id)
            return self.refuse(msg, record, (
                exc.status, "invalid_request_error" if exc.status < 500 else "server_error", exc.code, str(exc), None))
        if lora is ADAPTER_WAITING:
            return False  # its adapter is not in this worker's view of `adapters` yet, or is being written
        try:
            self.engine.add_request(request_id, list(record["prompt_token_ids"]), params,
                                    cache_salt=record["cache_salt"], resume_token_ids=resumed_tokens,
                                    resume_text_chars=int(resume.get("text_chars") or 0), **(
                                        {"lora": lora} if lora is not None else {}))
        except LoraLoadError as exc:
            self.adapters.forget(request_id)
            log.error("request %s: its adapter cannot be loaded: %s", request_id, exc)
            return self.refuse(msg, record, (
                500, "server_error", "adapter_load_failed", f"The adapter could not be loaded: {exc}", None))
        except (ValueError, TypeError, OverflowError) as exc:
            return self.refuse(msg, record, (400, "invalid_request_error", "invalid_request", str(exc), None))
        self.adapters.forget(request_id)
        self.fly(msg, record, resume)
        return True

    def refuse(self, msg: Any, record: InferenceRequested, error: Refusal) -> bool:
        return self.replies.end_unstarted(record, msg.partition(), msg.offset(), "failed", "error", error)

    def fly(self, msg: Any, record: InferenceRequested, resume: Mapping[str, Any]) -> None:
        """Book a request the engine took: in flight from its partition and offset."""
        started = now_ms()
        log.info("%s request %s (work partition %s offset %s)", "resumed" if resume else "started",
                 record["request_id"], msg.partition(), msg.offset())
        flight = InFlight(record, msg.partition(), msg.offset(), resume.get("started_at_ms") or started)
        if resume:
            # timings and text position carry over, so the completion reads as one run
            flight.first_token_at_ms = resume.get("first_token_at_ms")
            flight.text_chars = int(resume.get("text_chars") or 0)
            flight.cached_tokens = int(resume.get("cached_tokens") or 0)
        self.book.in_flight[request_id_of(record)] = flight
        if not resume:
            self.metrics.queue_time.observe(max(0, started - record["arrived_at_ms"]) / 1000)
