"""Requests in: dedupe, the tenant's switch, the quota reservation and the queue's cap.

A request the gate has seen before changes nothing; one a previous owner already released
(found in `work` on takeover) or one cancelled before it arrived is recorded as such and
never queued; every other one is queued with its tokens reserved, or answered at once
(403 for a disabled tenant, 400 for values the queue refuses, 429 for a full window or queue).
"""
from __future__ import annotations

import logging

from schedulers import QueuedRequest, QueueFull, RejectReason, parse_priority
from schedulers.priority import InvalidPriorityClass
from schedulers.rejections import rejection_message
from schemas.records import InferenceRequested
from streams.gate_outputs import rejection, request_completed
from streams.gate_state import GateState
from streams.tenants import TenantSettings

log = logging.getLogger("tokenmill.streams.gate")


class RequestAdmission:
    def __init__(self, state: GateState) -> None:
        self.state = state

    def on_request(self, rec: InferenceRequested, now: float) -> None:
        st = self.state
        rid = rec.get("request_id")
        if not rid:
            log.warning("request without request_id ignored (event %s)", rec.get("event_id"))
            return
        if rid in st.records or rid in st.released or rid in st.ended:
            return  # redelivered or replayed
        tenant_id = rec["tenant_id"]
        settings = st.tenants.get(tenant_id)
        if settings.disabled and rid not in st.in_work:
            # Ingress refuses a disabled tenant's keys, but work published before (or around) the
            # switch, and batch lines, still arrive here: never admitted, answered.
            self._reject(rec, 403, "permission_error", "tenant_disabled", rejection_message("tenant_disabled"), None)
            return
        st.ledger.set_limits(tenant_id, settings.limits)
        tokens = int(rec["reserved_tokens"]) or (
            len(rec["prompt_token_ids"]) + rec["sampling"]["max_tokens"] * rec["sampling"]["n"])

        if self._settled_without_queueing(rid, rec, tokens, now):
            return
        queued = self._queued_request(rid, rec, settings, now)
        if queued is None:
            return
        if st.queue.depth(tenant_id) >= settings.max_queued:
            self._reject(rec, 429, "rate_limit_error", "queue_full", rejection_message("queue_full"), 1.0)
            return
        self._admit(rec, queued, settings.max_queued, tokens, now)

    def _settled_without_queueing(self, rid: str, rec: InferenceRequested, tokens: int, now: float) -> bool:
        """A request a previous owner already released (it is in `work`), or one cancelled before it
        arrived: recorded as such, never queued. False for every other request."""
        st = self.state
        tenant_id = rec["tenant_id"]
        if rid in st.in_work:
            # Released by a previous owner that crashed before recording it: it is in
            # `work` already, so it counts as admitted and released, never again queued.
            st.ledger.reserve(tenant_id, rid, tokens, now)
            st.forget_in_work(rid)
            st.mark_released(rid, rec, None, now)
            st.tenant_changed(tenant_id)
            return True
        if rid in st.early_cancels:
            st.forget_early_cancel(rid)
            st.emit(request_completed(rec, "cancelled", "cancelled", now, st.usage_topic))
            st.end(rid, now)
            return True
        return False

    def _queued_request(self, rid: str, rec: InferenceRequested, settings: TenantSettings,
                        now: float) -> QueuedRequest | None:
        """The queue's entry for a request (an unknown priority class runs as batch), or None once
        the request is answered 400 for a value the queue refuses."""
        try:
            priority = parse_priority(rec.get("priority"))
        except InvalidPriorityClass:
            priority = parse_priority("batch")
        try:
            return QueuedRequest(
                request_id=rid, tenant_id=rec["tenant_id"], priority=priority,
                prompt_tokens=len(rec["prompt_token_ids"]),
                max_tokens=max(1, rec["sampling"]["max_tokens"]) * max(1, rec["sampling"]["n"]),
                enqueued_at=now, weight=settings.fairness_weight,
                deadline=rec["deadline_ms"] / 1000.0, payload=rec["model"])
        except ValueError as exc:
            self._reject(rec, 400, "invalid_request_error", "invalid_request", str(exc), None)
            return None

    def _admit(self, rec: InferenceRequested, queued: QueuedRequest, max_queued: int, tokens: int,
               now: float) -> None:
        """Reserves the request's tokens in its tenant's window and queues it, or answers 429 (a
        window or the tenant's queue is full) with the reservation given back."""
        st = self.state
        rid, tenant_id = queued.request_id, queued.tenant_id
        admission = st.ledger.reserve(tenant_id, rid, tokens, now)
        if not admission.admitted:
            if admission.reason is RejectReason.DUPLICATE_REQUEST:
                return
            assert admission.reason is not None  # a refusal always says why
            reason = admission.reason.value
            self._reject(rec, 429, "rate_limit_error", reason, rejection_message(reason), admission.retry_after_s)
            st.tenant_changed(tenant_id)
            return
        try:
            st.queue.enqueue(queued, max_queued=max_queued)
        except QueueFull:
            st.ledger.release(rid, now)
            self._reject(rec, 429, "rate_limit_error", "queue_full", rejection_message("queue_full"), 1.0)
            st.tenant_changed(tenant_id)
            return
        st.record_queued(rid, rec, queued)
        st.tenant_changed(tenant_id)
        st.metrics.admitted(tenant_id, queued.priority.value)

    def _reject(self, rec: InferenceRequested, status: int, error_type: str, code: str, message: str,
                retry_after: float | None) -> None:
        self.state.emit(rejection(rec, status, error_type, code, message, retry_after))
        self.state.metrics.rejected(rec["tenant_id"], code)
