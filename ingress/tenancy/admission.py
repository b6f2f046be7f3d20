"""Edge admission: the cheap, local quota check before anything is queued.

Each ingress process keeps a QuotaLedger of its own reservations and merges in the
authoritative usage streams publishes on `quota-state`, so several ingress replicas
share one tenant's limit instead of each granting it in full. Streams re-checks
everything it receives; this is where rejecting is still cheap.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from infra.kafka import clients as kafka_clients
from infra.kafka.compacted_view import CompactedFollower
from http_api.openai_errors import APIError
from ingress.tenancy.directory import Caller
from schedulers import QuotaConfig, QuotaLedger, TenantLimits, TokenUsage
from schedulers.rejections import rejection_message
from infra.config import token_weights_from_env
from schemas import topics

log = logging.getLogger(__name__)


def limits_of(tenant: dict) -> TenantLimits:
    def positive(v):
        return v if v and v > 0 else None

    return TenantLimits(requests_per_minute=positive(tenant["requests_per_minute"]),
                        tokens_per_minute=positive(tenant["tokens_per_minute"]),
                        max_concurrent=positive(tenant["max_concurrent"]),
                        monthly_token_budget=positive(tenant["monthly_token_budget"]))


@dataclass
class Reservation:
    tenant_id: str
    request_id: str
    tokens: int
    headers: dict[str, str]
    ended: bool = False


class EdgeAdmission:
    """The ledger of this process's reservations, merged with streams' authoritative usage (`apply_remote`,
    fed by `quota_state_follower`). Called from the event loop and the follower's thread, hence the lock."""

    def __init__(self):
        self.ledger = QuotaLedger(QuotaConfig(weights=token_weights_from_env()))
        self._lock = threading.Lock()

    # --- the authoritative view from streams ---
    def apply_remote(self, state: dict) -> None:
        with self._lock:
            self.ledger.apply_remote_usage(
                state["tenant_id"], used_tokens_in_window=state["tokens_in_window"],
                used_requests_in_window=state["requests_in_window"], month_used=state["month_tokens_used"],
                as_of=state["timestamp_ms"] / 1000.0)

    # --- per request ---
    def precheck(self, caller: Caller) -> None:
        """Refuse a tenant that is already out of quota before paying for parsing and tokenizing."""
        limits = limits_of(caller.tenant)
        with self._lock:
            self.ledger.set_limits(caller.tenant_id, limits)
            snap = self.ledger.snapshot(caller.tenant_id, time.time())
            _, concurrent = self.ledger.in_flight(caller.tenant_id)
        reason: str | None = None
        retry = 0.0  # with a reason: seconds until it no longer holds
        if snap.remaining_requests is not None and snap.remaining_requests <= 0:
            reason, retry = "rate_limit_requests", snap.reset_requests_s
        elif snap.remaining_tokens is not None and snap.remaining_tokens <= 0:
            reason, retry = "rate_limit_tokens", snap.reset_tokens_s
        elif limits.max_concurrent is not None and concurrent >= limits.max_concurrent:
            reason, retry = "concurrency_limit", 1.0
        if reason is not None:
            headers = snap.headers()
            headers["Retry-After"] = str(max(1, round(retry + 0.49)))
            raise APIError(429, rejection_message(reason), code=reason, headers=headers)

    def meter(self, caller: Caller) -> dict[str, str]:
        """Count a read (a lookup, a listing, a replay: anything that queues no inference) against the
        tenant's request rate, or refuse it with a 429 (`rate_limit_requests`); its rate-limit headers.
        A read takes no concurrency slot and no tokens: those bound what it holds (read_limits.py)."""
        with self._lock:
            self.ledger.set_limits(caller.tenant_id, limits_of(caller.tenant))
            admission = self.ledger.count_request(caller.tenant_id, time.time())
        headers = admission.rate_limits.headers()
        if not admission.admitted:
            raise _rejection(admission, headers)
        return headers

    def admit(self, caller: Caller, request_id: str, tokens: int) -> Reservation:
        with self._lock:
            self.ledger.set_limits(caller.tenant_id, limits_of(caller.tenant))
            admission = self.ledger.reserve(caller.tenant_id, request_id, tokens, time.time())
        headers = admission.rate_limits.headers()
        if not admission.admitted:
            raise _rejection(admission, headers)
        return Reservation(caller.tenant_id, request_id, tokens, headers)

    def grow(self, reservation: Reservation, tokens: int) -> None:
        """The request's size is known now (after tokenizing): reserve the rest of its tokens, or
        refuse it (the caller releases the reservation; its request and slot were counted)."""
        with self._lock:
            admission = self.ledger.grow(reservation.request_id, tokens, time.time())
        headers = admission.rate_limits.headers()
        if not admission.admitted:
            raise _rejection(admission, headers)
        reservation.tokens = tokens
        reservation.headers = headers

    def settle(self, reservation: Reservation, prompt: int, completion: int, cached: int) -> None:
        if reservation.ended:
            return
        reservation.ended = True
        with self._lock:
            self.ledger.settle(reservation.request_id, TokenUsage(prompt, completion, cached), time.time())

    def release(self, reservation: Reservation) -> None:
        if reservation.ended:
            return
        reservation.ended = True
        with self._lock:
            self.ledger.release(reservation.request_id, time.time())

    def in_flight(self, tenant_id: str) -> tuple[int, int]:
        with self._lock:
            return self.ledger.in_flight(tenant_id)


def quota_state_follower(admission: EdgeAdmission, process_id: str) -> CompactedFollower:
    """Follows `quota-state` (streams' usage per tenant) into `admission`; start and stop it with the process."""
    dead_letters = kafka_clients.DeadLetters(f"{process_id}-quota")

    def apply(msg) -> None:
        if msg.value() is None:
            return
        event = dead_letters.decode(msg, ("QuotaState",))
        if event is not None:
            admission.apply_remote(event.record)

    return CompactedFollower(topics.QUOTA_STATE.name, f"{process_id}-quota", apply, dead_letters=dead_letters)


def _rejection(admission, headers: dict[str, str]) -> APIError:
    reason = admission.reason.value
    if admission.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(admission.retry_after_s + 0.49)))
    message = rejection_message(reason)
    if admission.retry_after_s is None and reason == "rate_limit_tokens":
        message += " This request alone is larger than the per-minute token limit."
    return APIError(429, message, code=reason, headers=headers)
