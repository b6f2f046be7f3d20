"""The gate: authoritative quota, the fair queue and release against credits.

This is the whole decision logic of streams as one single-threaded state machine with
no I/O. The owner loop (owner.py) feeds it decoded events and the clock, sends the
``Output`` records it returns, and writes its dirty table entries (durable_state.py).

Lifecycle of a request id, as streams sees it::

    requests ──> reserved (QuotaLedger) ──> queued (FairQueue) ──> released to `work`
                     │                          │                       │
                     └─ 429 rejected            ├─ shed at deadline     └─ settled on `usage`
                        (RequestError only;     │  (503 + RequestCompleted "shed")
                        never admitted)         └─ cancelled (RequestCompleted "cancelled")

Every admitted request ends exactly once: by streams (shed, cancelled while queued)
or by its worker (the `usage` event settles it). Ended ids are remembered, so a
redelivered or replayed record changes nothing.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from schedulers import (
    AgingPolicy,
    Charge,
    FairQueueConfig,
    QueuedRequest,
    QueueFull,
    QuotaConfig,
    RejectReason,
    TokenUsage,
    parse_priority,
)
from schedulers.fairness_index import ServiceWindow
from schedulers.preemption import PreemptionPolicy, RunningSequence, WaitingRequest
from schedulers.priority import InvalidPriorityClass, PriorityClass
from schedulers.rejections import rejection_message
from schemas import codec, topics
from streams import durable_state as ds
from streams.config import StreamsSettings
from streams.credits import PoolCredits
from streams.placement import Placer
from streams.tenants import TenantBook, TenantSettings

log = logging.getLogger("tokenmill.streams.gate")

SWEEP_INTERVAL_S = 5.0
# A preemption the worker has not confirmed by then (the sequence ended first, or its worker
# is gone) stops counting as a slot on the way.
PREEMPT_CONFIRM_S = 5.0
# A request preempted this often runs to its end (bounds the recompute one request can cost).
MAX_PREEMPTIONS_PER_REQUEST = 3



@dataclass
class Output:
    topic: str
    key: str | None
    event: str
    record: dict[str, Any]
    partition: int | None = None
    release_of: str | None = None  # set on a `work` record: delivery is tracked


class NullMetrics:
    def __getattr__(self, name):
        return lambda *a, **k: None


class Gate:
    def __init__(self, settings: StreamsSettings, state: dict[str, Any] | None = None, metrics=None) -> None:
        self.settings = settings
        self.metrics = metrics or NullMetrics()
        self.quota_config = QuotaConfig(weights=settings.token_weights, ended_ttl_s=settings.ended_ttl_s)
        self.queue_config = FairQueueConfig(aging=AgingPolicy(settings.batch_aging_s))
        self.tenants = TenantBook()
        self.work_topic = settings.topic(topics.WORK)
        self.usage_topic = settings.topic(topics.USAGE)
        self.quota_topic = settings.topic(topics.QUOTA_STATE)
        self.dirty: dict[str, Any] = {}
        self._fq_dirty = self._credits_dirty = self._pos_dirty = self._workpos_dirty = False
        self._quota_dirty: set[str] = set()
        self._quota_published: dict[str, float] = {}
        self._last_shed = 0.0
        self._last_sweep = 0.0
        self.out: list[Output] = []
        self.preemptions_topic = settings.topic(topics.PREEMPTIONS)
        self.cancellations_topic = settings.topic(topics.CANCELLATIONS)
        self.preemption = PreemptionPolicy(hysteresis_s=settings.preempt_hysteresis_s)
        # victim request id -> (the request its slot is for, model, asked at); in memory only: a new
        # owner simply asks again if the pool is still unfair
        self.preempting: dict[str, tuple[str, str, float]] = {}
        # model -> requests a preemption freed a slot for, released ahead of the queue's order
        self.owed: dict[str, dict[str, float]] = {}
        self.service = ServiceWindow()
        self._restore(state or {})

    # ================================================================ restore

    def _restore(self, state: dict[str, Any]) -> None:
        self.records: dict[str, dict] = {}  # queued: request id -> InferenceRequested record
        self.released: dict[str, dict] = {}  # released, not ended: request id -> info
        self.ended: dict[str, float] = {}
        self.early_cancels: dict[str, float] = {}
        self.in_work: dict[str, float] = {}
        usage: dict[str, dict] = {}
        reservations: list[dict] = []
        queued: list[dict] = []
        charges: list[dict] = []
        for key, value in state.items():
            if key.startswith(ds.REQ):
                rid = key[len(ds.REQ):]
                if value.get("res"):
                    reservations.append(value["res"])
                if value["st"] == "queued":
                    self.records[rid] = value["rec"]
                    queued.append(value["q"])
                else:
                    self.released[rid] = value
                    if value.get("charge"):
                        charges.append(value["charge"])
            elif key.startswith(ds.ENDED):
                self.ended[key[len(ds.ENDED):]] = float(value)
            elif key.startswith(ds.EARLY_CANCEL):
                self.early_cancels[key[len(ds.EARLY_CANCEL):]] = float(value)
            elif key.startswith(ds.IN_WORK):
                self.in_work[key[len(ds.IN_WORK):]] = float(value)
            elif key.startswith(ds.TENANT):
                usage[key[len(ds.TENANT):]] = value
        self.ledger = ds.DurableLedger.restore(usage, reservations, self.ended, self.quota_config)
        self.queue = ds.DurableQueue.restore(state.get(ds.FQ), queued, charges, self.queue_config)
        self.credits = PoolCredits.from_dict(state.get(ds.CREDITS), self.settings.advert_ttl_s,
                                             self.settings.in_transit_ttl_s)
        self.placer = Placer(self.credits, self.settings.placement)
        self.positions: dict[str, int] = dict(state.get(ds.POS) or {})
        self.workpos: dict[str, int] = dict(state.get(ds.WORKPOS) or {})
        self._quota_dirty = set(usage)

    # ================================================================ inputs

    def handle(self, kind: str, key: bytes | None, record: dict[str, Any] | None, now: float,
               event: str | None = None) -> None:
        if event == "RequestPreempted":
            self.on_preempted(record, now)
        elif kind == "requests":
            self.on_request(record, now)
        elif kind == "usage":
            self.on_usage(record, now)
        elif kind == "cancellations":
            self.on_cancel(record, now)
        elif kind == "capacity":
            if self.credits.on_advert(record):
                self._credits_dirty = True
                self.placer.on_advert(record, now)
        elif kind == "tenants":
            tenant_id = record["tenant_id"] if record else (key or b"").decode()
            applied = self.tenants.apply(tenant_id, record)
            if applied is not None and applied.disabled:
                self._stop_tenant(tenant_id, now)

    def apply_ledger_month(self, tenant_id: str, month_tokens: int, now: float) -> None:
        """Month-to-date tokens from the billing ledger, the source of truth for the monthly budget:
        whatever it counts beyond what this ledger saw (e.g. before a fresh start) is added."""
        self.ledger.set_limits(tenant_id, self.tenants.get(tenant_id).limits)
        if self.ledger.apply_remote_usage(tenant_id, 0, 0, month_tokens, now):
            self._tenant_changed(tenant_id)

    def note_position(self, topic: str, partition: int, offset: int) -> None:
        self.positions[f"{topic}:{partition}"] = offset + 1
        self._pos_dirty = True

    def on_request(self, rec: dict[str, Any], now: float) -> None:
        rid = rec.get("request_id")
        if not rid:
            log.warning("request without request_id ignored (event %s)", rec.get("event_id"))
            return
        if rid in self.records or rid in self.released or rid in self.ended:
            return  # redelivered or replayed
        tenant_id = rec["tenant_id"]
        settings = self.tenants.get(tenant_id)
        if settings.disabled and rid not in self.in_work:
            # Ingress refuses a disabled tenant's keys, but work published before (or around) the
            # switch, and batch lines, still arrive here: never admitted, answered.
            self._reject(rec, 403, "permission_error", "tenant_disabled", rejection_message("tenant_disabled"), None)
            return
        self.ledger.set_limits(tenant_id, settings.limits)
        tokens = int(rec["reserved_tokens"]) or (
            len(rec["prompt_token_ids"]) + rec["sampling"]["max_tokens"] * rec["sampling"]["n"])

        if self._settled_without_queueing(rec, tokens, now):
            return
        queued = self._queued_request(rec, settings, now)
        if queued is None:
            return
        if self.queue.depth(tenant_id) >= settings.max_queued:
            self._reject(rec, 429, "rate_limit_error", "queue_full", rejection_message("queue_full"), 1.0)
            return
        self._admit(rec, queued, settings.max_queued, tokens, now)

    def _settled_without_queueing(self, rec: dict[str, Any], tokens: int, now: float) -> bool:
        """A request a previous owner already released (it is in `work`), or one cancelled before it
        arrived: recorded as such, never queued. False for every other request."""
        rid, tenant_id = rec["request_id"], rec["tenant_id"]
        if rid in self.in_work:
            # Released by a previous owner that crashed before recording it: it is in
            # `work` already, so it counts as admitted and released, never again queued.
            self.ledger.reserve(tenant_id, rid, tokens, now)
            del self.in_work[rid]
            self.dirty[ds.IN_WORK + rid] = None
            self._mark_released(rid, rec, None, now)
            self._tenant_changed(tenant_id)
            return True
        if rid in self.early_cancels:
            del self.early_cancels[rid]
            self.dirty[ds.EARLY_CANCEL + rid] = None
            self.out.append(self._completed(rec, "cancelled", "cancelled", now))
            self._end(rid, now)
            return True
        return False

    def _queued_request(self, rec: dict[str, Any], settings: TenantSettings, now: float) -> QueuedRequest | None:
        """The queue's entry for a request (an unknown priority class runs as batch), or None once
        the request is answered 400 for a value the queue refuses."""
        try:
            priority = parse_priority(rec.get("priority"))
        except InvalidPriorityClass:
            priority = parse_priority("batch")
        try:
            return QueuedRequest(
                request_id=rec["request_id"], tenant_id=rec["tenant_id"], priority=priority,
                prompt_tokens=len(rec["prompt_token_ids"]),
                max_tokens=max(1, rec["sampling"]["max_tokens"]) * max(1, rec["sampling"]["n"]),
                enqueued_at=now, weight=settings.fairness_weight,
                deadline=rec["deadline_ms"] / 1000.0, payload=rec["model"])
        except ValueError as exc:
            self._reject(rec, 400, "invalid_request_error", "invalid_request", str(exc), None)
            return None

    def _admit(self, rec: dict[str, Any], queued: QueuedRequest, max_queued: int, tokens: int,
               now: float) -> None:
        """Reserves the request's tokens in its tenant's window and queues it, or answers 429 (a
        window or the tenant's queue is full) with the reservation given back."""
        rid, tenant_id = queued.request_id, queued.tenant_id
        admission = self.ledger.reserve(tenant_id, rid, tokens, now)
        if not admission.admitted:
            if admission.reason is RejectReason.DUPLICATE_REQUEST:
                return
            reason = admission.reason.value
            self._reject(rec, 429, "rate_limit_error", reason, rejection_message(reason),
                         admission.retry_after_s)
            self._tenant_changed(tenant_id)
            return
        try:
            self.queue.enqueue(queued, max_queued=max_queued)
        except QueueFull:
            self.ledger.release(rid, now)
            self._reject(rec, 429, "rate_limit_error", "queue_full", rejection_message("queue_full"), 1.0)
            self._tenant_changed(tenant_id)
            return
        self.records[rid] = rec
        self.dirty[ds.REQ + rid] = {
            "st": "queued", "rec": rec,
            "q": {**queued.to_dict(), "seq": self.queue.seq_of(rid)},
            "res": self.ledger.reservation_state(rid),
        }
        self._fq_dirty = True
        self._tenant_changed(tenant_id)
        self.metrics.admitted(tenant_id, queued.priority.value)

    def on_usage(self, rec: dict[str, Any], now: float) -> None:
        rid = rec.get("request_id")
        if not rid:
            return
        info = self.released.pop(rid, None)
        self.preempting.pop(rid, None)  # ended before its worker could give the slot up
        if info is not None:
            prompt = int(rec["prompt_tokens"])
            completion = int(rec["completion_tokens"])
            cached = min(max(0, int(rec.get("cached_tokens") or 0)), prompt)
            self.ledger.settle(rid, TokenUsage(prompt, completion, cached), now)
            # A resumed request's earlier part was settled when it was preempted, and its
            # recomputed prompt is not charged to the tenant a second time.
            resumed = info.get("resumed_tokens", 0)
            self._settle_service(info, 0 if resumed else prompt, max(0, completion - resumed), now)
            if rec.get("ttft_ms") is not None:
                self.metrics.tenant_ttft(info["tenant"], float(rec["ttft_ms"]) / 1000.0)
            self._end(rid, now)
            self._tenant_changed(info["tenant"])
            return
        if rid in self.records:
            # Ended by someone else while still queued here (should not happen): end it.
            self.queue.remove(rid)
            rec_q = self.records.pop(rid)
            self.ledger.settle(rid, int(rec.get("prompt_tokens", 0)) + int(rec.get("completion_tokens", 0)), now)
            self._end(rid, now)
            self._tenant_changed(rec_q["tenant_id"])
            self._fq_dirty = True
            return
        if rid in self.in_work:
            # Released before a crash and finished before we re-read its request.
            del self.in_work[rid]
            self.dirty[ds.IN_WORK + rid] = None
            self._end(rid, now)

    def _settle_service(self, info: dict, prompt: int, completion: int, now: float) -> None:
        """Replace the release-time estimate by the service actually given."""
        if not info.get("charge"):
            return
        charge = Charge.from_dict(info["charge"])
        self.queue.on_usage(charge.tenant_id, prompt, completion, charge)
        self.service.add(charge.tenant_id, self.queue_config.weighted_tokens(prompt, completion) / charge.weight, now)
        self._fq_dirty = True

    def on_preempted(self, rec: dict[str, Any], now: float) -> None:
        """A worker gave a slot up: queue the request again where it stood, to resume from what it
        already streamed. A hand-back for a request that ended, or that streams never released,
        changes nothing."""
        rid = rec.get("request_id")
        victim = self.preempting.pop(rid, None)
        info = self.released.get(rid)
        if info is None:
            return
        original = info.get("rec")
        if original is None:  # released before records were kept with releases: cannot queue it again
            log.error("request %s was preempted but its record is unknown; ending it", rid)
            self.released.pop(rid)
            self.ledger.release(rid, now)
            self._end(rid, now)
            self._tenant_changed(info["tenant"])
            return
        del self.released[rid]
        tokens = [int(t) for t in rec["completion_token_ids"]]
        before = info.get("resumed_tokens", 0)
        self._settle_service(info, 0 if before else len(original["prompt_token_ids"]), len(tokens) - before, now)
        previous = original.get("resume") or {}
        resumed = dict(original, resume={
            "completion_token_ids": tokens, "text_chars": int(rec["text_chars"]),
            "preemptions": int(previous.get("preemptions") or 0) + 1,
            "started_at_ms": rec.get("started_at_ms"), "first_token_at_ms": rec.get("first_token_at_ms"),
            "cached_tokens": int(rec.get("cached_tokens") or 0)})
        sampling = original["sampling"]
        queued = QueuedRequest(
            request_id=rid, tenant_id=info["tenant"], priority=parse_priority(info["priority"]),
            prompt_tokens=len(original["prompt_token_ids"]),
            max_tokens=max(1, sampling["max_tokens"] * max(1, sampling["n"]) - len(tokens)),
            enqueued_at=info.get("enqueued_at", now), weight=self.tenants.get(info["tenant"]).fairness_weight,
            deadline=original["deadline_ms"] / 1000.0, payload=original["model"])
        seq = info.get("seq")
        self.queue.requeue(queued, seq if seq is not None else self.queue.next_seq())
        self.records[rid] = resumed
        self.dirty[ds.REQ + rid] = {"st": "queued", "rec": resumed,
                                    "q": {**queued.to_dict(), "seq": self.queue.seq_of(rid)},
                                    "res": self.ledger.reservation_state(rid)}
        self._fq_dirty = True
        self.metrics.preempted(info["tenant"], rec.get("reason") or "fairness")
        if self.tenants.get(info["tenant"]).disabled:
            self._stop_tenant(info["tenant"], now)  # disabled while it ran: it ends here, not resumes
        if victim is not None:
            log.info("request %s preempted after %d tokens for %s", rid, len(tokens), victim[0])

    def on_cancel(self, rec: dict[str, Any], now: float) -> None:
        rid = rec.get("request_id")
        if not rid:
            return
        if rid in self.records:
            self.queue.remove(rid)
            queued = self.records.pop(rid)
            self._close_reservation(queued, now)
            self.out.append(self._completed(queued, "cancelled", "cancelled", now))
            self._end(rid, now)
            self._fq_dirty = True
            self._tenant_changed(queued["tenant_id"])
            self.metrics.cancelled(queued["tenant_id"])
            return
        if rid in self.released or rid in self.ended or rid in self.early_cancels:
            return  # the worker deals with released requests
        self.early_cancels[rid] = now
        self.dirty[ds.EARLY_CANCEL + rid] = now

    def _stop_tenant(self, tenant_id: str, now: float) -> None:
        """A tenant was disabled: its queued requests end now (answered), its running ones are
        cancelled at their workers (which then end and bill them for what they streamed)."""
        for rid, rec in [(r, q) for r, q in self.records.items() if q["tenant_id"] == tenant_id]:
            self.queue.remove(rid)
            del self.records[rid]
            self.out.append(self._error(rec, 403, "permission_error", "tenant_disabled",
                                        rejection_message("tenant_disabled"), None))
            self.out.append(self._completed(rec, "cancelled", "tenant_disabled", now))
            self._close_reservation(rec, now)
            self._end(rid, now)
            self._fq_dirty = True
        for rid, info in self.released.items():
            if info["tenant"] == tenant_id:
                cancel = codec.new_event("RequestCancelled", request_id=rid, tenant_id=tenant_id,
                                         reason="tenant_disabled")
                self.out.append(Output(self.cancellations_topic, rid, "RequestCancelled", cancel))
        self._tenant_changed(tenant_id)

    def mark_in_work(self, request_ids: list[str], now: float) -> int:
        """Takeover: these ids are already in `work` (released by a previous owner that
        did not live to record it). Returns how many were still queued here."""
        fixed = 0
        for rid in request_ids:
            if rid in self.records:
                self.queue.remove(rid)
                rec = self.records.pop(rid)
                self._fq_dirty = True
                self._mark_released(rid, rec, None, now)
                fixed += 1
                log.warning("request %s was already released before the restart; not releasing again", rid)
            elif rid not in self.released and rid not in self.ended and rid not in self.in_work:
                self.in_work[rid] = now
                self.dirty[ds.IN_WORK + rid] = now
        return fixed

    # ================================================================ periodic

    def step(self, now: float) -> None:
        """After a batch of events (and on every tick): shed, release, publish."""
        if now - self._last_shed >= self.settings.shed_interval_s:
            self._last_shed = now
            self.shed(now)
            if self.credits.expire(now):
                self._credits_dirty = True
            self.placer.expire(now)
        if now - self._last_sweep >= SWEEP_INTERVAL_S:
            self._last_sweep = now
            self._sweep(now)
        self.release_round(now)
        self.preempt_round(now)
        self._publish_quota(now)

    def shed(self, now: float) -> None:
        for shed in self.queue.shed_expired(now):
            rid = shed.request.request_id
            rec = self.records.pop(rid)
            self._fq_dirty = True
            self.out.append(self._error(rec, 503, "service_unavailable", "deadline_exceeded",
                                        "The request waited past its deadline and was not started.",
                                        self.settings.shed_retry_after_s))
            self.out.append(self._completed(rec, "shed", "deadline", now))
            self._close_reservation(rec, now)
            self._end(rid, now)
            self._tenant_changed(rec["tenant_id"])
            self.metrics.shed(rec["tenant_id"], shed.reason.value)

    def release_round(self, now: float) -> int:
        available = self.credits.available(now)
        if not any(v > 0 for v in available.values()) or not self.records:
            return 0
        released = 0
        # Slots freed by preemption go to the requests they were freed for.
        for model, owed in self.owed.items():
            for rid in list(owed):
                if available.get(model, 0) <= 0:
                    break
                del owed[rid]
                release = self.queue.pop_request(rid, now)
                if release is not None:
                    available[model] -= 1
                    self._release(release, now)
                    released += 1

        def can_start(request: QueuedRequest) -> bool:
            return available.get(request.payload, 0) > 0

        for release in self.queue.releases(now, can_start):
            available[release.request.payload] -= 1
            self._release(release, now)
            released += 1
            if available[release.request.payload] <= 0 and not any(v > 0 for v in available.values()):
                break  # every credit is used: the rest of the queue need not be looked at
        if released:
            self._credits_dirty = True
            self._fq_dirty = True
        return released

    def _release(self, release, now: float) -> None:
        req = release.request
        rec = self.records.pop(req.request_id)
        work = dict(rec, released_at_ms=int(now * 1000))
        where = self.placer.address(rec, now)
        self.out.append(Output(self.work_topic, req.request_id, "InferenceRequested", work,
                               partition=where.partition, release_of=req.request_id))
        self.credits.on_release(req.payload, req.request_id, now, where.worker_id)
        self.metrics.placed(req.payload, where.worker_id, where.reason, where.loads_adapter)
        self._mark_released(req.request_id, rec, release.charge, now, req, release.tier, release.seq)
        self.metrics.released(req.tenant_id, req.priority.value, now - req.enqueued_at,
                              max(0.0, now - rec["timestamp_ms"] / 1000.0))

    def preempt_round(self, now: float) -> int:
        """Ask workers to give up slots for queued requests owed one (schedulers/preemption.py),
        per model whose pool is full. Returns how many preemptions were asked for."""
        for rid in [r for r, (_, _, at) in self.preempting.items() if now - at > PREEMPT_CONFIRM_S]:
            del self.preempting[rid]
        for model, owed in self.owed.items():
            for rid in [r for r, at in owed.items() if now - at > PREEMPT_CONFIRM_S or r not in self.records]:
                del owed[rid]
        if not self.settings.preemption or not self.records:
            return 0
        available = self.credits.available(now)
        waiting: dict[str, list[WaitingRequest]] = {}
        for tier, req in self.queue.heads(now):
            if req.payload in available and available[req.payload] <= 0:
                waiting.setdefault(req.payload, []).append(
                    WaitingRequest(req.request_id, req.tenant_id, tier, req.weight))
        if not waiting:
            return 0
        running: dict[str, list[RunningSequence]] = {}
        for rid, info in self.released.items():
            if info["model"] not in waiting or rid in self.preempting:
                continue
            rec = info.get("rec")
            preemptible = (rec is not None and rec["sampling"]["n"] == 1
                           and int((rec.get("resume") or {}).get("preemptions") or 0) < MAX_PREEMPTIONS_PER_REQUEST)
            running.setdefault(info["model"], []).append(RunningSequence(
                rid, info["tenant"], parse_priority(info.get("tier") or info["priority"]),
                self.tenants.get(info["tenant"]).fairness_weight, float(info["released_at"]), preemptible))
        asked = 0
        for model, heads in waiting.items():
            pending_for = set(self.owed.get(model, {}))
            for decision in self.preemption.decide(running.get(model, []), heads, 0, pending_for, now):
                victim = decision.victim
                self.preempting[victim.request_id] = (decision.beneficiary.request_id, model, now)
                self.owed.setdefault(model, {})[decision.beneficiary.request_id] = now
                record = codec.new_event("PreemptRequested", request_id=victim.request_id,
                                         tenant_id=victim.tenant_id, model=model, reason=decision.reason,
                                         for_request_id=decision.beneficiary.request_id)
                self.out.append(Output(self.preemptions_topic, victim.request_id, "PreemptRequested", record))
                asked += 1
        return asked

    def on_work_delivered(self, partition: int, offset: int) -> None:
        key = str(partition)
        if self.workpos.get(key, -1) < offset + 1:
            self.workpos[key] = offset + 1
            self._workpos_dirty = True

    def _sweep(self, now: float) -> None:
        horizon = now - self.settings.ended_ttl_s
        for table, prefix in ((self.ended, ds.ENDED), (self.early_cancels, ds.EARLY_CANCEL),
                              (self.in_work, ds.IN_WORK)):
            for rid in [r for r, t in table.items() if t < horizon]:
                del table[rid]
                self.dirty[prefix + rid] = None

    def _publish_quota(self, now: float) -> None:
        if not self._quota_dirty:
            return
        interval = self.settings.quota_publish_interval_s
        for tenant_id in list(self._quota_dirty):
            if now - self._quota_published.get(tenant_id, 0.0) < interval:
                continue
            self._quota_dirty.discard(tenant_id)
            self._quota_published[tenant_id] = now
            usage = self.ledger.usage(tenant_id, now)
            tokens, count = self.ledger.in_flight(tenant_id)
            record = codec.new_event(
                "QuotaState", tenant_id=tenant_id, window_start_ms=int(usage.window_start * 1000),
                window_ms=int(self.quota_config.window_s * 1000), requests_in_window=usage.used_requests_in_window,
                tokens_in_window=usage.used_tokens_in_window, in_flight_requests=count, in_flight_tokens=tokens,
                month=usage.month, month_tokens_used=usage.month_used)
            record["timestamp_ms"] = int(now * 1000)
            self.out.append(Output(self.quota_topic, tenant_id, "QuotaState", record))

    # ================================================================ helpers

    def _close_reservation(self, rec: dict, now: float) -> None:
        """End a queued request's reservation: refunded if it never ran, or, for a preempted request
        that had started, settled with its prompt and what it streamed: the same tokens the ledger
        bills from the RequestCompleted (billing_pipeline/ledger.py ``ran``)."""
        if _ran(rec):
            self.ledger.settle(rec["request_id"],
                               TokenUsage(len(rec["prompt_token_ids"]), _streamed_tokens(rec), 0), now)
        else:
            self.ledger.release(rec["request_id"], now)

    def _mark_released(self, rid: str, rec: dict, charge: Charge | None, now: float,
                       queued: QueuedRequest | None = None, tier: PriorityClass | None = None,
                       seq: int | None = None) -> None:
        # The record stays, so a preempted request can be queued again (with its place: seq).
        info = {"st": "released", "tenant": rec["tenant_id"], "model": rec["model"],
                "priority": rec.get("priority", "interactive"),
                "charge": charge.to_dict() if charge else None, "released_at": now,
                "res": self.ledger.reservation_state(rid), "rec": rec,
                "tier": tier.value if tier else (rec.get("priority") or "interactive"),
                "seq": seq, "enqueued_at": queued.enqueued_at if queued else now,
                "resumed_tokens": _streamed_tokens(rec)}
        self.released[rid] = info
        self.dirty[ds.REQ + rid] = info

    def _end(self, rid: str, now: float) -> None:
        self.ended[rid] = now
        self.dirty[ds.REQ + rid] = None
        self.dirty[ds.ENDED + rid] = now

    def _tenant_changed(self, tenant_id: str) -> None:
        self.dirty[ds.TENANT + tenant_id] = self.ledger.tenant_state(tenant_id)
        self._quota_dirty.add(tenant_id)

    def _error(self, rec: dict, status: int, error_type: str, code: str, message: str,
               retry_after: float | None) -> Output:
        err = codec.new_event("RequestError", request_id=rec["request_id"], status_code=status, error_type=error_type,
                              code=code, message=message,
                              retry_after_s=None if retry_after is None else float(retry_after))
        return Output(rec["reply_topic"], rec["request_id"], "RequestError", err, partition=rec["reply_partition"])

    def _reject(self, rec: dict, status: int, error_type: str, code: str, message: str,
                retry_after: float | None) -> None:
        if retry_after is not None:
            retry_after = math.ceil(retry_after * 1000) / 1000
        self.out.append(self._error(rec, status, error_type, code, message, retry_after))
        self.metrics.rejected(rec["tenant_id"], code)

    def _completed(self, rec: dict, status: str, finish_reason: str, now: float) -> Output:
        """The usage event of a request streams ends itself (shed, cancelled while queued). A preempted
        one reports the tokens it streamed and its first start, so the ledger bills them whatever the
        status; one that never ran reports no start and no completion token, and is not billed."""
        now_ms = int(now * 1000)
        resume = rec.get("resume") or {}
        first = resume.get("first_token_at_ms")
        usage = codec.new_event(
            "RequestCompleted", request_id=rec["request_id"], tenant_id=rec["tenant_id"], model=rec["model"],
            status=status, finish_reason=finish_reason, priority=rec.get("priority", "interactive"),
            prompt_tokens=len(rec["prompt_token_ids"]), completion_tokens=_streamed_tokens(rec), cached_tokens=0,
            reserved_tokens=int(rec.get("reserved_tokens") or 0), arrived_at_ms=rec["arrived_at_ms"],
            started_at_ms=resume.get("started_at_ms"), first_token_at_ms=first, finished_at_ms=now_ms,
            ttft_ms=None if first is None else float(first - rec["arrived_at_ms"]), tpot_ms=None,
            queue_ms=float(max(0, now_ms - rec["arrived_at_ms"])), worker_id=None,
            api_key_id=rec.get("api_key_id"), batch_id=rec.get("batch_id"))
        return Output(self.usage_topic, rec["tenant_id"], "RequestCompleted", usage)

    # ================================================================ output side

    def take_outputs(self) -> list[Output]:
        out, self.out = self.out, []
        return out

    def take_dirty(self) -> dict[str, Any]:
        if self._fq_dirty:
            self.dirty[ds.FQ] = self.queue.globals_state()
        if self._credits_dirty:
            self.dirty[ds.CREDITS] = self.credits.to_dict()
        if self._pos_dirty:
            self.dirty[ds.POS] = dict(self.positions)
        if self._workpos_dirty:
            self.dirty[ds.WORKPOS] = dict(self.workpos)
        self._fq_dirty = self._credits_dirty = self._pos_dirty = self._workpos_dirty = False
        dirty, self.dirty = self.dirty, {}
        return dirty

    # ================================================================ views

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return {
            "depths": self.queue.depths(),
            "credits": self.credits.available(now),
            "in_transit": {m: self.credits.in_transit(m) for m in self.credits.models()},
            "released_in_flight": len(self.released),
        }

    def begin_work_positions(self, ends: dict[int, int]) -> None:
        """The first owner starts reading `work` at its end, since nothing of ours is there yet; these
        positions are saved with the next state commit, as delivered ones are."""
        for partition, offset in ends.items():
            self.workpos[str(partition)] = offset
        self._workpos_dirty = True


def _streamed_tokens(rec: dict) -> int:
    """Tokens a queued request already streamed (non-zero only after a preemption)."""
    return len((rec.get("resume") or {}).get("completion_token_ids") or [])


def _ran(rec: dict) -> bool:
    """Whether a queued request had reached a GPU before (it was preempted after starting): its
    prompt and streamed tokens are then billed whatever ends it; one that never ran bills nothing."""
    resume = rec.get("resume") or {}
    return resume.get("started_at_ms") is not None or _streamed_tokens(rec) > 0
