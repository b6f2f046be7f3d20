"""How admitted requests end: settled on `usage`, cancelled, shed at their deadline, stopped with
their tenant, or found already released on takeover.

Every admitted request ends exactly once: here (shed, cancelled while queued, its tenant
disabled while queued) or by its worker (the `usage` event settles it). Ended ids are
remembered, so a redelivered or replayed record changes nothing.
"""
from __future__ import annotations

import logging

from schedulers import TokenUsage
from schedulers.rejections import rejection_message
from schemas.records import RequestCancelled, RequestCompleted
from streams.gate_outputs import request_cancelled, request_completed, request_error
from streams.gate_state import GateState, ReleasedEntry

log = logging.getLogger("tokenmill.streams.gate")


class RequestEndings:
    def __init__(self, state: GateState, cancellations_topic: str) -> None:
        self.state = state
        self.cancellations_topic = cancellations_topic

    def on_usage(self, rec: RequestCompleted, now: float) -> None:
        st = self.state
        rid = rec.get("request_id")
        if not rid:
            return
        info = st.released.pop(rid, None)
        st.preempting.pop(rid, None)  # ended before its worker could give the slot up
        if info is not None:
            self._settle_released(rid, info, rec, now)
            return
        if rid in st.records:
            # Ended by someone else while still queued here (should not happen): end it.
            st.queue.remove(rid)
            rec_q = st.records.pop(rid)
            st.ledger.settle(rid, int(rec.get("prompt_tokens", 0)) + int(rec.get("completion_tokens", 0)), now)
            st.end(rid, now)
            st.tenant_changed(rec_q["tenant_id"])
            st.queue_dirty = True
            return
        if rid in st.in_work:
            # Released before a crash and finished before we re-read its request.
            st.forget_in_work(rid)
            st.end(rid, now)

    def _settle_released(self, rid: str, info: ReleasedEntry, rec: RequestCompleted, now: float) -> None:
        st = self.state
        prompt = int(rec["prompt_tokens"])
        completion = int(rec["completion_tokens"])
        cached = min(max(0, int(rec.get("cached_tokens") or 0)), prompt)
        st.ledger.settle(rid, TokenUsage(prompt, completion, cached), now)
        # A resumed request's earlier part was settled when it was preempted, and its
        # recomputed prompt is not charged to the tenant a second time.
        resumed = info.get("resumed_tokens", 0)
        st.settle_service(info, 0 if resumed else prompt, max(0, completion - resumed), now)
        ttft_ms = rec.get("ttft_ms")
        if ttft_ms is not None:
            st.metrics.tenant_ttft(info["tenant"], float(ttft_ms) / 1000.0)
        st.end(rid, now)
        st.tenant_changed(info["tenant"])

    def on_cancel(self, rec: RequestCancelled, now: float) -> None:
        st = self.state
        rid = rec.get("request_id")
        if not rid:
            return
        if rid in st.records:
            st.queue.remove(rid)
            queued = st.records.pop(rid)
            st.close_reservation(rid, queued, now)
            st.emit(request_completed(queued, "cancelled", "cancelled", now, st.usage_topic))
            st.end(rid, now)
            st.queue_dirty = True
            st.tenant_changed(queued["tenant_id"])
            st.metrics.cancelled(queued["tenant_id"])
            return
        if rid in st.released or rid in st.ended or rid in st.early_cancels:
            return  # the worker deals with released requests
        st.note_early_cancel(rid, now)

    def shed(self, now: float) -> None:
        """Queued requests past their deadline are answered 503 and end, never started."""
        st = self.state
        for shed in st.queue.shed_expired(now):
            rid = shed.request.request_id
            rec = st.records.pop(rid)
            st.queue_dirty = True
            st.emit(request_error(rec, 503, "service_unavailable", "deadline_exceeded",
                                  "The request waited past its deadline and was not started.",
                                  st.settings.shed_retry_after_s))
            st.emit(request_completed(rec, "shed", "deadline", now, st.usage_topic))
            st.close_reservation(rid, rec, now)
            st.end(rid, now)
            st.tenant_changed(rec["tenant_id"])
            st.metrics.shed(rec["tenant_id"], shed.reason.value)

    def stop_tenant(self, tenant_id: str, now: float) -> None:
        """A tenant was disabled: its queued requests end now (answered), its running ones are
        cancelled at their workers (which then end and bill them for what they streamed)."""
        st = self.state
        for rid, rec in [(r, q) for r, q in st.records.items() if q["tenant_id"] == tenant_id]:
            st.queue.remove(rid)
            del st.records[rid]
            st.emit(request_error(rec, 403, "permission_error", "tenant_disabled",
                                  rejection_message("tenant_disabled"), None))
            st.emit(request_completed(rec, "cancelled", "tenant_disabled", now, st.usage_topic))
            st.close_reservation(rid, rec, now)
            st.end(rid, now)
            st.queue_dirty = True
        for rid, info in st.released.items():
            if info["tenant"] == tenant_id:
                st.emit(request_cancelled(rid, tenant_id, "tenant_disabled", self.cancellations_topic))
        st.tenant_changed(tenant_id)

    def mark_in_work(self, request_ids: list[str], now: float) -> int:
        """Takeover: these ids are already in `work` (released by a previous owner that
        did not live to record it). Returns how many were still queued here."""
        st = self.state
        fixed = 0
        for rid in request_ids:
            if rid in st.records:
                st.queue.remove(rid)
                rec = st.records.pop(rid)
                st.queue_dirty = True
                st.mark_released(rid, rec, None, now)
                fixed += 1
                log.warning("request %s was already released before the restart; not releasing again", rid)
            elif rid not in st.released and rid not in st.ended and rid not in st.in_work:
                st.note_in_work(rid, now)
        return fixed
