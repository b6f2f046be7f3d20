"""A GPU worker: adapts the engine to Kafka.

Consumes `work` (one consumer group per model), feeds the engine, and after every
engine step sends one `ReplyBatch` per reply address, one `RequestCompleted` per
finished request, and capacity credits. Offsets are committed only once a request
has ended, so a crashed worker's requests are redelivered and regenerated.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from gpu_consumers.after_delivery import AfterDelivery, fan_out
from gpu_consumers.adapter_cache import ADAPTER_WAITING, AdapterCache, AdapterUnavailable
from gpu_consumers.engine import Engine, LoraLoadError, SamplingParams
from gpu_consumers.engine.core.sequence import CONSTRAINT_VIOLATED, KV_CACHE_FULL, LORA_LOAD_FAILED
from gpu_consumers.metrics import WorkerMetrics
from gpu_consumers.offset_tracker import OffsetTracker
from gpu_consumers.prefix_summary import PrefixSummary
from gpu_consumers.recorded_usage import RecordedUsage
from gpu_consumers.refill_window import RefillWindow
from gpu_consumers.reply_readers import ReplyReaders
from infra import kafka_clients
from infra.grammars import GrammarBusy, GrammarCompiler, GrammarError
from infra.group_consumer import TOKEN_PATH, HealingGroupConsumer
from infra.partition_reader import PartitionReader
from infra.resilient_producer import ResilientProducer
from schemas import codec, topics
from schemas.records import InferenceRequested, PreemptRequested, SamplingSpec

log = logging.getLogger("tokenmill.worker")

COMMIT_INTERVAL_S = 0.2
# How long a revoke waits for the delivery reports of what ended here, so that the next owner of the
# partitions does not run it again; bounded, because a rebalance waits on it.
REVOKE_FLUSH_S = 2.0
ADVERTISE_INTERVAL_S = 1.0
REAP_INTERVAL_S = 0.2
# How long an idle worker (nothing running, nothing waiting on a grammar) waits for work in one loop turn.
# A fetch returns the moment work arrives, so this adds no latency; it only sets how often the loop's
# Kafka calls run with nothing to do (at 20 ms, 5 % of a core for an idle worker; ~1 % at 100 ms).
IDLE_WAIT_S = 0.1
# Idle with events still awaiting their delivery reports (a request that just ended: its work offset is
# committed only after them, after_delivery.py), the loop waits on those reports, not on work, and commits
# as soon as they come: until that commit a worker killed would have its last request run (and its
# RequestCompleted produced) again by the next owner of the partition.
SETTLING_WAIT_S = 0.02
CANCELLED_MEMORY = 10_000
# Reads of the committed offsets at an assignment before falling back to librdkafka (see _on_assign).
COMMITTED_READ_ATTEMPTS = 3
# A loop turn (one engine step and its Kafka calls) this long is a stall: every thread's stack goes to
# the log then, once per stall. Steps take milliseconds to a few seconds; a worker stuck in a client
# call keeps its partitions (and their requests) for max.poll.interval.ms, and this says where it is.
STALL_DUMP_AFTER_S = 30.0
_COMPILING = object()  # a structured-output request whose grammar is still compiling


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class InFlight:
    record: InferenceRequested
    partition: int
    offset: int
    started_at_ms: int
    first_token_at_ms: int | None = None
    completion_tokens: dict[int, int] = field(default_factory=dict)
    finished_choices: set[int] = field(default_factory=set)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    cached_tokens: int = 0
    text_chars: int = 0  # characters of choice 0 sent so far (where a preempted stream resumes)
    error: str | None = None  # why the engine ended it (its adapter could not be loaded)

    @property
    def request_id(self) -> str:
        return self.record["request_id"]

    @property
    def reply_address(self) -> tuple[str, int]:
        return self.record["reply_topic"], self.record["reply_partition"]


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    return SamplingParams(
        max_tokens=spec["max_tokens"], temperature=spec["temperature"], top_p=spec["top_p"],
        top_k=spec["top_k"], min_p=spec["min_p"], repetition_penalty=spec["repetition_penalty"],
        presence_penalty=spec["presence_penalty"], frequency_penalty=spec["frequency_penalty"],
        seed=spec["seed"], stop=list(spec["stop"]), stop_token_ids=list(spec["stop_token_ids"]),
        ignore_eos=spec["ignore_eos"], n=spec["n"], logprobs=spec["logprobs"],
    )


class GpuWorker:
    def __init__(self, engine: Engine, model_name: str, worker_id: str | None = None, metrics_port: int | None = None,
                 refill_window: RefillWindow | None = None):
        self.engine = engine
        self.refill_window = refill_window or RefillWindow()
        self._ended_last_step = 0
        self._last_step_s = 0.0
        self.model_name = model_name
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = WorkerMetrics(self.worker_id, model_name)
        if metrics_port:
            self.metrics.serve(metrics_port)
        self.incarnation = uuid.uuid4().hex[:12]
        self.producer = ResilientProducer(kafka_clients.producer_config(self.worker_id))
        self.work = HealingGroupConsumer(topics.WORK.name, self._work_consumer, "work consumer", TOKEN_PATH,
                                         on_assign=self._on_assign, on_revoke=self._on_revoke,
                                         on_lost=self._on_lost)
        self.cancels: PartitionReader | None = None  # opened at the ends of its topics by _subscribe
        self.readers = ReplyReaders(self.worker_id)
        self._last_reap = 0.0
        self.offsets = OffsetTracker()
        self.recorded_usage = RecordedUsage()
        self.in_flight: dict[str, InFlight] = {}
        self.pending: list[tuple[Any, InferenceRequested]] = []  # decoded work not yet in the engine
        self.grammars: GrammarCompiler | None = None  # warmed at start (warm_grammars), else made when first asked
        self._grammars_warming: threading.Thread | None = None
        self.cancelled: dict[str, None] = {}
        self.consumed_total = 0
        self._stop = False
        self._last_commit = 0.0
        self._commit_due = False  # a request's last events were delivered: commit at the next turn
        self._last_advert = 0.0
        self._last_free = None
        self._assigned = False
        self._partitions: set[int] = set()  # the `work` partitions assigned to this worker
        self.prefix_summary = PrefixSummary(engine)
        self._committing: dict[int, tuple[int, str]] = {}
        self._turn_began: float | None = None  # when run()'s loop began its current turn
        # The tenants' LoRA adapters, followed from `adapters` and written to disk on first need (started by run)
        self.adapters = AdapterCache(self.worker_id)

    # --- Kafka plumbing ---
    def _work_consumer(self) -> Consumer:
        # Static membership (the worker id is the member's instance id): a worker whose session lapsed
        # while the broker was away, or that was restarted under the same id, gets its partitions
        # back at once. A new member id would wait out the old one's session (10 s) in a rebalance
        # before any `work` partition was read again. Worker ids must therefore be unique in a pool
        # (they already are: capacity adverts are keyed by them). The price: a worker that stops
        # cleanly does not leave the group either, so its partitions move after the session timeout.
        return Consumer(kafka_clients.consumer_config(
            f"gpu-{self.model_name}", self.worker_id,
            **{"max.poll.interval.ms": 300000, "group.instance.id": self.worker_id,
               "on_commit": self._on_commit}))

    def _on_assign(self, consumer, partitions):
        # Reading starts exactly at the committed offsets, given explicitly. Left to librdkafka, a
        # partition that came back to a worker that had owned it before was seen to resume past them,
        # where this worker had fetched to when the partition left (so a request that another worker
        # was running when it died was never delivered again). Requests past the committed position that
        # a previous owner already finished are listed in the commit's metadata: skip them rather than
        # run (and bill) them again.
        committed = None
        for attempt in range(COMMITTED_READ_ATTEMPTS):
            # Retried: the fallback below is librdkafka's own placement, the one seen to skip a dead
            # worker's request; a coordinator slow to answer (a loaded machine, a rebalance of another
            # group on the same broker) must not send us there on its first timeout.
            try:
                committed = consumer.committed(partitions, timeout=10)
                break
            except Exception as exc:
                log.warning("assigned work partitions %s; could not read their committed offsets "
                            "(attempt %d of %d): %s", [p.partition for p in partitions], attempt + 1,
                            COMMITTED_READ_ATTEMPTS, exc)
        if committed is None:  # librdkafka then starts each partition where it sees fit
            log.error("assigned work partitions %s without their committed offsets; librdkafka places them",
                      [p.partition for p in partitions])
        else:
            log.info("assigned work partitions %s at committed offsets %s", [p.partition for p in partitions],
                     {tp.partition: tp.offset for tp in committed})
            for tp in committed:
                if tp.offset >= 0:
                    self.offsets.adopt(tp.partition, tp.offset, tp.metadata)
            self.recorded_usage.assigned(tp.partition for tp in committed)
            consumer.incremental_assign([TopicPartition(tp.topic, tp.partition, tp.offset) for tp in committed])
        # Credits only make sense once this worker actually reads `work`.
        self._assigned = True
        self._partitions = {p.partition for p in consumer.assignment()} | {p.partition for p in partitions}
        self.prefix_summary.resend()
        self.advertise(force=True)

    def _on_revoke(self, consumer, partitions):
        self._give_up(partitions, commit=True)

    def _on_lost(self, consumer, partitions):
        # The session lapsed (the broker was away): the group has moved on, so a commit could only
        # fail, and waiting for it would stall generation for everyone else.
        self._give_up(partitions, commit=False)

    def _give_up(self, partitions, commit: bool) -> None:
        revoked = {p.partition for p in partitions}
        log.info("%s work partitions %s", "revoked" if commit else "lost", sorted(revoked))
        # Another worker will get these requests again; stop ours without billing them.
        for request_id, flight in list(self.in_flight.items()):
            if flight.partition in revoked:
                self.engine.abort(request_id)
                del self.in_flight[request_id]
        self.pending = [(m, r) for m, r in self.pending if m.partition() not in revoked]
        if commit:
            # A clean hand-over: what ended here is committed, not run again by the next owner,
            # once its last events are delivered (their delivery reports mark it done).
            self.producer.flush(REVOKE_FLUSH_S)
            self._commit(force=True)
        for partition in revoked:
            self.offsets.forget(partition)
            self.recorded_usage.forget(partition)
        self._partitions -= revoked
        if self._assigned:
            self.advertise(force=True)  # streams must stop addressing requests to the partitions it lost

    @property
    def consumer(self) -> Consumer:
        """The current `work` client (a fresh one after healing; see infra/group_consumer.py)."""
        return self.work.client

    def _heal_work_consumer(self) -> None:
        """With room for more, a stuck `work` client is replaced, keeping what runs; a full engine
        fetches nothing on purpose."""
        room = self.engine.num_free_slots() - len(self.pending)
        if self.work.heal(expect_fetching=room > 0 and self._assigned):
            self._partitions = set()  # until the new client's assignment arrives

    def _subscribe(self) -> None:
        self.work.subscribe()

        probe = Consumer(kafka_clients.consumer_config(None, f"{self.worker_id}-cancels-end"))

        def ends() -> dict[tuple[str, int], int]:
            found = {}
            for topic in (topics.CANCELLATIONS.name, topics.PREEMPTIONS.name):
                meta = probe.list_topics(topic, timeout=10).topics[topic]
                for p in meta.partitions:
                    found[(topic, p)] = probe.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            return found

        try:
            starts = kafka_clients.with_retries(ends, "reading the end of `cancellations` and `preemptions`")
        finally:
            probe.close()
        # A cancellation or preemption left unfetched after a broker restart would never be acted on.
        self.cancels = PartitionReader(f"{self.worker_id}-cancels", starts)

    def _commit(self, force: bool = False, wait: bool = False) -> None:
        """Commit what finished. Asynchronous on the serving path: a synchronous commit waits for the
        group coordinator, for ten seconds or more after a broker restart, with every sequence stalled.
        A request whose last events were just delivered is committed at once (`_commit_due`), to
        narrow the window in which a crash would run it again."""
        if not (force or self._commit_due) and time.monotonic() - self._last_commit < COMMIT_INTERVAL_S:
            return
        self._commit_due = False
        self._last_commit = time.monotonic()
        moved = self.offsets.committable()
        if not moved:
            return
        self._committing.update(moved)
        self.offsets.mark_committed(moved)
        # one line per commit: where a request was last seen when a takeover starts past it (issue 31's lost request)
        log.info("committing work positions %s", {p: o for p, (o, _meta) in sorted(moved.items())})
        try:
            self.consumer.commit(offsets=[TopicPartition(topics.WORK.name, p, o, metadata=meta)
                                          for p, (o, meta) in moved.items()], asynchronous=not wait)
        except Exception as exc:  # e.g. during a rebalance; offered again at the next commit
            log.warning("offset commit failed: %s", exc)
            for partition, position in moved.items():
                self.offsets.commit_failed(partition, position)

    def _on_commit(self, err, partitions) -> None:
        for tp in partitions:
            position = self._committing.pop(tp.partition, None)
            if position is not None and (err is not None or tp.error is not None):
                log.warning("offset commit failed: %s", err or tp.error)
                self.offsets.commit_failed(tp.partition, position)

    def _produce(self, topic: str, key, name: str, record: dict, partition: int | None = None,
                 on_delivery=None) -> None:
        kafka_clients.produce_event(self.producer, topic, key, name, record, partition=partition,
                                    on_delivery=on_delivery)

    def _settle(self, request_id: str, partition: int, offset: int) -> AfterDelivery:
        """A request's offset, done once every event that ends it is delivered (after_delivery.py)."""
        def done() -> None:
            self.offsets.done(partition, offset)
            self._commit_due = True
        return AfterDelivery(f"request {request_id} (work partition {partition} offset {offset})", done)

    def advertise(self, force: bool = False, stopping: bool = False) -> None:
        if not self._assigned and not stopping:
            return
        free = (self.engine.num_free_slots() - len(self.pending), self.engine.num_free_blocks())
        now = time.monotonic()
        if (not force and free == self._last_free and now - self._last_advert < ADVERTISE_INTERVAL_S
                and not self.prefix_summary.due(now)):
            return
        self._last_free = free
        self._last_advert = now
        self.adapters.sweep_disk()  # files of versions taken down since (a directory listing when any was)
        stats = self.engine.stats
        self.metrics.update_from_engine(stats, len(self.pending))
        record = codec.new_event(
            "CapacityAdvertised", worker_id=self.worker_id, incarnation=self.incarnation, model=self.model_name,
            free_slots=max(0, free[0]), free_kv_blocks=free[1], total_slots=self.engine.max_num_seqs,
            total_kv_blocks=self.engine.num_total_blocks, block_size=self.engine.block_size,
            running=int(stats.get("running", 0)), waiting=int(stats.get("waiting", 0)) + len(self.pending),
            consumed_total=self.consumed_total, stopping=stopping,
            work_partitions=sorted(self._partitions) if not stopping else [],
            cached_blocks=self.prefix_summary.take(now),
            resident_adapters=list(getattr(self.engine, "resident_adapters", list)()),
        )
        self._produce(topics.CAPACITY.name, self.worker_id, "CapacityAdvertised", record)

    # --- request lifecycle ---
    def _error_reply(self, record: InferenceRequested, status: int, error_type: str, code: str, message: str,
                     retry_after: float | None = None, settle: AfterDelivery | None = None) -> None:
        err = codec.new_event("RequestError", request_id=record["request_id"], status_code=status,
                              error_type=error_type, code=code, message=message, retry_after_s=retry_after)
        self._produce(record["reply_topic"], record["request_id"], "RequestError", err,
                      partition=record["reply_partition"], on_delivery=settle.expect() if settle else None)

    def _complete(self, record: InferenceRequested, status: str, *, flight: InFlight | None = None,
                  finish_reason: str | None = None, settle: AfterDelivery | None = None) -> None:
        finished = now_ms()
        # Ended before it ran here: a resumed (preempted) request still counts what it streamed before.
        resume = record.get("resume") or {}
        completion = sum(flight.completion_tokens.values()) if flight else len(resume.get("completion_token_ids") or [])
        first = flight.first_token_at_ms if flight else resume.get("first_token_at_ms")
        started = flight.started_at_ms if flight else resume.get("started_at_ms")
        cached = flight.cached_tokens if flight else int(resume.get("cached_tokens") or 0)
        tpot = None
        if first is not None and completion > record["sampling"]["n"]:
            tpot = (finished - first) / max(1, completion / record["sampling"]["n"] - 1)
        usage = codec.new_event(
            "RequestCompleted", request_id=record["request_id"], tenant_id=record["tenant_id"],
            model=record["model"], status=status, finish_reason=finish_reason, priority=record["priority"],
            prompt_tokens=len(record["prompt_token_ids"]), completion_tokens=completion,
            cached_tokens=cached, reserved_tokens=record["reserved_tokens"],
            arrived_at_ms=record["arrived_at_ms"], started_at_ms=started, first_token_at_ms=first,
            finished_at_ms=finished, ttft_ms=(first - record["arrived_at_ms"]) if first else None, tpot_ms=tpot,
            queue_ms=(started - record["arrived_at_ms"]) if started else None, worker_id=self.worker_id,
            api_key_id=record["api_key_id"], batch_id=record["batch_id"],
            adapter=(record.get("adapter") or {}).get("name"),
        )
        if self.recorded_usage.already_recorded(record["request_id"]):
            log.info("request %s ran again after its partition changed owner; its previous owner's "
                     "RequestCompleted stands", record["request_id"])
        else:
            self._produce(topics.USAGE.name, record["tenant_id"], "RequestCompleted", usage,
                          on_delivery=settle.expect() if settle else None)
        self.metrics.outcome(status)
        self.metrics.prompt_tokens.inc(len(record["prompt_token_ids"]))
        self.metrics.generation_tokens.inc(completion)
        if tpot is not None:
            self.metrics.tpot.observe(tpot / 1000)

    def _take(self, msg) -> None:
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
        self.pending.append((msg, record))

    def _start_pending(self) -> None:
        self.pending = [(msg, record) for msg, record in self.pending if not self._started_or_ended(msg, record)]

    def _started_or_ended(self, msg, record: InferenceRequested) -> bool:
        """Start one decoded request, or end it unstarted; False while it must wait (no room in the
        KV cache yet, or its grammar still compiling)."""
        request_id = record["request_id"]
        if self.readers.gone(record) and request_id not in self.cancelled:
            log.info("cancelling %s before it starts: its ingress no longer reads %s:%s", request_id,
                     record["reply_topic"], record["reply_partition"])
            self.cancelled[request_id] = None  # nobody would read the stream
        running = self.in_flight.get(request_id)
        if running is not None:
            log.warning("work record %s:%s (request %s) delivered while it runs from %s:%s",
                        msg.partition(), msg.offset(), request_id, running.partition, running.offset)
            if (running.partition, running.offset) != (msg.partition(), msg.offset()):
                self.offsets.done(msg.partition(), msg.offset())
            return True
        if request_id in self.cancelled:
            return self._end_unstarted(msg, record, "cancelled", "cancelled")
        if now_ms() >= record["deadline_ms"]:  # never start a request whose deadline has passed
            return self._end_unstarted(msg, record, "shed", "deadline", (
                503, "service_unavailable", "deadline_exceeded",
                "The request waited past its deadline and was not started.", 1.0))
        resume = record.get("resume") or {}
        resumed_tokens = list(resume.get("completion_token_ids") or [])
        if not self.engine.can_admit(len(record["prompt_token_ids"]) + len(resumed_tokens)):
            return False
        params = sampling_params(record["sampling"])
        try:
            params.constraint = self._constraint(record)
        except GrammarBusy as exc:  # waited too long for a compile slot: not the schema's fault
            return self._end_unstarted(msg, record, "failed", "error", (
                503, "service_unavailable", "grammar_compiler_busy", str(exc), 1.0))
        except GrammarError as exc:
            return self._end_unstarted(msg, record, "failed", "error", (
                400, "invalid_request_error", "invalid_response_format", str(exc), None))
        if params.constraint is _COMPILING:
            return False  # its grammar compiles off the step loop
        try:
            lora = self.adapters.lora_for(record)
        except AdapterUnavailable as exc:  # deleted before it started, or its files never arrived whole
            self.adapters.forget(request_id)
            return self._end_unstarted(msg, record, "failed", "error", (
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
            return self._end_unstarted(msg, record, "failed", "error", (
                500, "server_error", "adapter_load_failed", f"The adapter could not be loaded: {exc}", None))
        except (ValueError, TypeError, OverflowError) as exc:
            return self._end_unstarted(msg, record, "failed", "error", (
                400, "invalid_request_error", "invalid_request", str(exc), None))
        self.adapters.forget(request_id)
        self._fly(msg, record, resume)
        return True

    def _end_unstarted(self, msg, record: InferenceRequested, status: str, finish_reason: str,
                       error: tuple[int, str, str, str, float | None] | None = None) -> bool:
        """End a request that never ran: its error reply (status, type, code, message, retry-after) if
        any, its usage, and its offset done."""
        settle = self._settle(record["request_id"], msg.partition(), msg.offset())
        if error is not None:
            status_code, error_type, code, message, retry_after = error
            self._error_reply(record, status_code, error_type, code, message, retry_after=retry_after,
                              settle=settle)
        self._complete(record, status, finish_reason=finish_reason, settle=settle)
        settle.seal()
        return True

    def _fly(self, msg, record: InferenceRequested, resume: dict) -> None:
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
        self.in_flight[record["request_id"]] = flight
        if not resume:
            self.metrics.queue_time.observe(max(0, started - record["arrived_at_ms"]) / 1000)

    def _constraint(self, record: InferenceRequested):
        """The request's structured-output constraint factory, None for free text, or _COMPILING
        while its grammar compiles in the background."""
        text = record.get("response_format")
        if not text:
            return None
        if self.grammars is None:
            if self._grammars_warming is not None and self._grammars_warming.is_alive():
                return _COMPILING  # the compiler is being made off the step loop
            self.grammars = self._new_grammar_compiler()
        try:
            # bounded: a grammar stopped at its compile limit is a GrammarError, one that waits too
            # long for a compile slot a GrammarBusy (infra/grammars.py), never an endless wait
            compiled = self.grammars.ready(json.loads(text), tenant=record.get("tenant_id"))
        except GrammarError:
            raise
        except ValueError as exc:  # not JSON
            raise GrammarError(str(exc)) from None
        return _COMPILING if compiled is None else self.grammars.factory(compiled)

    def _new_grammar_compiler(self) -> GrammarCompiler:
        return GrammarCompiler(self.engine.tokenizer, self.engine.model.cfg.vocab_size,
                               sorted(self.engine.eos_token_ids))

    def warm_grammars(self) -> None:
        """Make the grammar compiler and start its compile processes in the background. Each process
        imports xgrammar and torch (~7 s of CPU on a quiet 2-core machine, far more under load); made
        at the first structured-output request instead, that cost fell on its caller, and the
        compiler's own set-up ran on the step loop, stalling every stream meanwhile."""
        def make() -> None:
            try:
                self.grammars = self._new_grammar_compiler()
            except Exception:  # noqa: BLE001 - the first structured request makes it again, and says why
                log.exception("grammar compiler warm-up failed")

        self._grammars_warming = threading.Thread(target=make, name="grammar-warmup", daemon=True)
        self._grammars_warming.start()

    def _cancel(self, request_id: str) -> None:
        self.cancelled[request_id] = None
        if len(self.cancelled) > CANCELLED_MEMORY:
            self.cancelled.pop(next(iter(self.cancelled)))
        flight = self.in_flight.pop(request_id, None)
        if flight is not None:
            log.info("cancelled %s (work partition %d offset %d)", request_id, flight.partition, flight.offset)
            self.engine.abort(request_id)
            settle = self._settle(request_id, flight.partition, flight.offset)
            self._complete(flight.record, "cancelled", flight=flight, finish_reason="cancelled", settle=settle)
            settle.seal()

    def _preempt(self, request: PreemptRequested) -> None:
        """Give up a request's slot on the gate's word: stop it, and hand it back to streams with what
        it produced so far; streams queues it again and releases it (here or elsewhere) to resume.
        Its `work` offset is done only once streams has the hand-back, so a crash in between
        redelivers the request and it is regenerated from the start, identically."""
        request_id = request["request_id"]
        flight = self.in_flight.get(request_id)
        if flight is not None:
            tokens = self.engine.output_token_ids(request_id)
            if tokens is None or flight.record["sampling"]["n"] != 1:
                # only single-choice requests are preempted; said, since streams counted on the slot
                log.info("preempt of %s ignored: %s", request_id,
                         "not single-choice" if tokens is not None else "not in the engine")
                return
            self.engine.abort(request_id)
            del self.in_flight[request_id]
            record, partition, offset = flight.record, flight.partition, flight.offset
            started, first, chars, cached = (flight.started_at_ms, flight.first_token_at_ms, flight.text_chars,
                                             flight.cached_tokens)
        else:
            waiting = next(((m, r) for m, r in self.pending if r["request_id"] == request_id), None)
            if waiting is None:
                log.info("preempt of %s ignored: not running or waiting here (finished, cancelled or elsewhere)",
                         request_id)
                return
            self.pending.remove(waiting)
            msg, record = waiting
            partition, offset = msg.partition(), msg.offset()
            resume = record.get("resume") or {}
            tokens = list(resume.get("completion_token_ids") or [])
            started, first = resume.get("started_at_ms"), resume.get("first_token_at_ms")
            chars, cached = int(resume.get("text_chars") or 0), int(resume.get("cached_tokens") or 0)
        log.info("preempted %s after %d tokens (%s)", request_id, len(tokens), request["reason"])
        self.metrics.preempted(request["reason"])
        handed_back = codec.new_event(
            "RequestPreempted", request_id=request_id, tenant_id=record["tenant_id"], model=record["model"],
            worker_id=self.worker_id, incarnation=self.incarnation, reason=request["reason"],
            completion_token_ids=tokens, text_chars=chars, started_at_ms=started, first_token_at_ms=first,
            cached_tokens=cached)

        def on_delivery(err, _msg, _where=(partition, offset)):
            if err is None:
                self.offsets.done(*_where)

        kafka_clients.produce_event(self.producer, topics.CAPACITY.name, self.worker_id, "RequestPreempted",
                                    handed_back, on_delivery=on_delivery)
        self.advertise(force=True)

    def _fetch(self, limit: int, wait: float, expect: int = 1) -> list:
        """Up to `limit` work messages: waits at most `wait` until `expect` of them are there, then
        takes whatever else has arrived without waiting."""
        got: list = []
        deadline = time.monotonic() + wait
        while len(got) < min(expect, limit):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got.extend(self.consumer.consume(num_messages=min(expect, limit) - len(got), timeout=left))
        if len(got) < limit:
            got.extend(self.consumer.consume(num_messages=limit - len(got), timeout=0))
        return got

    def _intake(self, room: int, busy: bool) -> list:
        """New work for the next step. After a step that ended requests, wait in the refill window
        (refill_window.py) for their successors; idle, wait briefly for a first request."""
        expect, wait = self.refill_window.plan(self._ended_last_step, room, self._last_step_s)
        self._ended_last_step = 0  # one window per step
        planned = expect
        if not busy and len(self.producer) and not self.pending:
            self.producer.poll(SETTLING_WAIT_S)  # returns at the first delivery report
            self._commit()
            expect, wait = max(expect, 1), 0.0  # then whatever work has arrived meanwhile
        elif not busy:
            expect, wait = max(expect, 1), max(wait, 0.02 if self.pending else IDLE_WAIT_S)
        msgs = self._fetch(room, wait=wait, expect=expect)
        if planned:
            self.refill_window.observe(planned, len(msgs))
        return msgs

    def _reap_orphans(self) -> None:
        """Cancel running requests whose ingress went away (killed, restarted, shut down)."""
        if time.monotonic() - self._last_reap < REAP_INTERVAL_S:
            return
        self._last_reap = time.monotonic()
        for request_id, flight in list(self.in_flight.items()):
            if self.readers.gone(flight.record):
                log.info("cancelling %s: its ingress no longer reads %s", request_id, flight.reply_address)
                self._cancel(request_id)

    def _poll_cancellations(self) -> None:
        for msg in self.cancels.read(0, max_messages=100):
            event = kafka_clients.decode_or_dead_letter(self.producer, msg, self.worker_id,
                                                        expect=("RequestCancelled", "PreemptRequested"))
            if event is None:
                continue
            if event.name == "PreemptRequested":
                request = codec.record_of(event, PreemptRequested)
                if request["model"] == self.model_name:
                    self._preempt(request)
            else:
                self._cancel(event.record["request_id"])

    def _step(self) -> None:
        self._ended_last_step = 0
        try:
            began = time.perf_counter()
            outputs = self.engine.step()
            self._last_step_s = time.perf_counter() - began
            self.metrics.step_time.observe(self._last_step_s)
        except Exception:
            log.exception("engine step failed; failing every request in flight")
            for request_id, flight in list(self.in_flight.items()):
                self.engine.abort(request_id)
                self._fail(flight, 500, "engine_error",
                           "Generation failed on the worker; the request was not finished.")
            self.in_flight.clear()
            return
        batches: dict[tuple[str, int], list[dict]] = defaultdict(list)
        ended: list[InFlight] = []
        broken: dict[str, InFlight] = {}
        stamp = now_ms()
        for out in outputs:
            flight = self.in_flight.get(out.request_id)
            if flight is None or out.request_id in broken:
                continue
            if out.finished and out.finish_reason in (CONSTRAINT_VIOLATED, LORA_LOAD_FAILED):
                broken[out.request_id] = flight
                flight.error = getattr(out, "error", None) if out.finish_reason == LORA_LOAD_FAILED else None
                continue
            batches[flight.reply_address].append(self._reply_item(flight, out, stamp))
            if out.finished and len(flight.finished_choices) == flight.record["sampling"]["n"]:
                ended.append(flight)
        ended = [flight for flight in ended if flight.request_id not in broken]
        settles = {flight.request_id: self._settle(flight.request_id, flight.partition, flight.offset)
                   for flight in ended}
        for (topic, partition), items in batches.items():
            items = [item for item in items if item["request_id"] not in broken]
            if items:
                reply = codec.new_event("ReplyBatch", worker_id=self.worker_id, items=items)
                ending = [settles[request_id].expect() for request_id in {item["request_id"] for item in items}
                          if request_id in settles]
                self._produce(topic, None, "ReplyBatch", reply, partition=partition, on_delivery=fan_out(ending))
        for request_id, flight in broken.items():
            # its grammar matcher failed: this request ends with an error, the batch goes on
            del self.in_flight[request_id]
            self.engine.abort(request_id)
            if flight.error is not None:  # its LoRA adapter could not be read: a clear error, not a hang
                log.error("request %s: its adapter could not be loaded: %s", request_id, flight.error)
                self._fail(flight, 500, "adapter_load_failed", f"The adapter could not be loaded: {flight.error}")
                continue
            log.error("request %s: its response_format matcher refused a token; ended with an error", request_id)
            self._fail(flight, 500, "grammar_error",
                       "Structured output failed on the worker; the request was not finished.")
        self._finish(ended, settles)

    def _reply_item(self, flight: InFlight, out, stamp: int) -> dict:
        """What one step produced for one choice, as a ReplyBatch item; the flight's tallies follow."""
        if out.new_token_ids and flight.first_token_at_ms is None:
            flight.first_token_at_ms = stamp
        flight.completion_tokens[out.choice_index] = out.completion_tokens
        flight.cached_tokens = max(flight.cached_tokens, out.cached_tokens)
        if out.choice_index == 0:
            flight.text_chars += len(out.text_delta)
        item = {
            "request_id": out.request_id, "choice_index": out.choice_index,
            "first_token_index": out.first_token_index, "token_ids": list(out.new_token_ids),
            "text": out.text_delta, "logprobs": _sampled_logprobs(out.new_token_ids, out.logprobs),
            # Clients get OpenAI's reasons; the ledger keeps the distinct one (RequestCompleted).
            "finish_reason": (("length" if out.finish_reason == KV_CACHE_FULL else out.finish_reason)
                              if out.finished else None), "usage": None,
        }
        if out.finished:
            flight.finished_choices.add(out.choice_index)
            flight.finish_reasons[out.choice_index] = out.finish_reason
            item["usage"] = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                             "cached_tokens": out.cached_tokens}
        return item

    def _fail(self, flight: InFlight, status: int, code: str, message: str) -> None:
        """End a request that ran with a server error: its reply, its usage (billed as far as it got)."""
        settle = self._settle(flight.request_id, flight.partition, flight.offset)
        self._error_reply(flight.record, status, "server_error", code, message, settle=settle)
        self._complete(flight.record, "failed", flight=flight, finish_reason="error", settle=settle)
        settle.seal()

    def _finish(self, ended: list[InFlight], settles: dict[str, AfterDelivery]) -> None:
        """Bill what ended; each offset is done once its last ReplyBatch (already produced, waiting on
        `settles`) and its usage are delivered."""
        for flight in ended:
            del self.in_flight[flight.request_id]
            settle = settles[flight.request_id]
            self._complete(flight.record, "finished", flight=flight, finish_reason=flight.finish_reasons.get(0),
                           settle=settle)
            settle.seal()
        self._ended_last_step = len(ended)

    def _watch_for_stalls(self) -> None:
        """On its own thread: a turn of run()'s loop past STALL_DUMP_AFTER_S gets one warning and one dump
        of every thread (faulthandler, to stderr: the service's log)."""
        dumped_for = None
        while not self._stop:
            time.sleep(STALL_DUMP_AFTER_S / 10)
            began = self._turn_began
            if began is not None and began != dumped_for and time.monotonic() - began >= STALL_DUMP_AFTER_S:
                log.warning("worker loop stalled: one turn has run %.0f s; every thread's stack follows",
                            time.monotonic() - began)
                faulthandler.dump_traceback(all_threads=True)
                dumped_for = began

    def run(self) -> None:
        threading.Thread(target=self._watch_for_stalls, name="tokenmill-stall-watch", daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        self.adapters.start()
        self._subscribe()
        log.info("worker %s serving %s", self.worker_id, self.model_name)
        try:
            while not self._stop:
                self._turn_began = time.monotonic()  # read by _watch_for_stalls
                self._poll_cancellations()
                self._reap_orphans()
                busy = self.engine.has_unfinished_requests()
                room = self.engine.num_free_slots() - len(self.pending)
                if room > 0:
                    for msg in self._intake(room, busy):
                        if msg.error():
                            continue
                        self._take(msg)
                if self.pending:
                    self._start_pending()
                if self.engine.has_unfinished_requests():
                    self._step()
                elif self.pending:
                    time.sleep(0.005)  # what waits is compiling its grammar: do not spin against it
                self.producer.poll(0)
                self._commit()
                self._heal_work_consumer()
                self.advertise()
        finally:
            self.shutdown()

    def stop(self) -> None:
        self._stop = True

    def shutdown(self) -> None:
        # In-flight requests are not finished: leave their offsets uncommitted for another worker.
        for request_id in list(self.in_flight):
            self.engine.abort(request_id)
        self.in_flight.clear()
        self.advertise(force=True, stopping=True)
        self._assigned = False  # nothing advertised after the stopping advert (closing revokes partitions)
        self.producer.flush(10)  # first: the delivery reports mark what ended as done (after_delivery.py)
        self._commit(force=True, wait=True)
        self.work.close()
        if self.cancels is not None:
            self.cancels.close()
        self.readers.close()
        self.adapters.stop()


def _sampled_logprobs(token_ids: list[int], logprobs) -> list[float] | None:
    """The logprob of each sampled token; the engine gives one {token_id: logprob} dict per token
    (the sampled one plus the top alternatives)."""
    if not logprobs:
        return None
    return [float(entry[token]) for token, entry in zip(token_ids, logprobs)]
