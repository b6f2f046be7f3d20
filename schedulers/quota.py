"""Quota arithmetic with reservations.

Each tenant has four independent limits (any may be ``None`` = unlimited):
requests per minute, tokens per minute, concurrent requests, and a monthly token
budget. Admission *reserves* the request's estimated quota tokens before the work
runs; when the real usage is known :meth:`QuotaLedger.settle` swaps the reservation
for it, and :meth:`QuotaLedger.release` drops it (cancel, error, shed, timeout).

Windows are **fixed**, epoch-aligned windows of ``window_s`` (60 s): admitted tokens
and requests count in the window in which they were admitted, for their whole life.
We chose fixed over sliding windows because (a) the "admitted tokens in a window
never exceed the limit" invariant is then exact and cheap to check, (b) the reset time
in the x-ratelimit-reset-* headers is exact, and (c) every process agrees on window
boundaries, so usage published by streams can be merged into ingress's local view.
The price is the usual boundary burst: up to 2x the limit across two adjacent windows.
Monthly budgets use UTC calendar months with the same count-at-admission rule.

Invariant (local ledger): at every admission,
``settled + reserved + new <= tokens_per_minute`` for the admission window, so the
window's admitted tokens never exceed the limit; only a settlement larger than its own
reservation (an estimate that was too small) can push the window over.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from schedulers.quota_counters import Reservation, TenantCounters
from schedulers.rate_limit_headers import RateLimitSnapshot
from schedulers.token_usage import TokenUsage, TokenWeights
from schedulers.windows import month_key, next_month_start, window_start

STATE_VERSION = 1


class RejectReason(str, Enum):
    RATE_LIMIT_REQUESTS = "rate_limit_requests"
    RATE_LIMIT_TOKENS = "rate_limit_tokens"
    CONCURRENCY_LIMIT = "concurrency_limit"
    MONTHLY_BUDGET_EXCEEDED = "monthly_budget_exceeded"
    # The request id already ran to an end here; admitting it again (a redelivered
    # record) would leak a reservation nobody will settle.
    DUPLICATE_REQUEST = "duplicate_request"


@dataclass(frozen=True)
class TenantLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    monthly_token_budget: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TenantLimits:
        return cls(**data)


@dataclass(frozen=True)
class Admission:
    admitted: bool
    tenant_id: str
    request_id: str
    reserved_tokens: int
    rate_limits: RateLimitSnapshot
    reason: RejectReason | None = None
    # Seconds until retrying can succeed; None when it never will as asked (a request
    # larger than the whole per-minute token limit) or is meaningless (duplicate).
    retry_after_s: float | None = None


@dataclass(frozen=True)
class QuotaUsage:
    """What one ledger counts for a tenant (settled + reserved). Streams publishes
    this; ingress feeds it to :meth:`QuotaLedger.apply_remote_usage`."""

    tenant_id: str
    window_start: float
    used_requests_in_window: int
    used_tokens_in_window: int
    month: str
    month_used: int
    as_of: float


@dataclass(frozen=True)
class QuotaConfig:
    window_s: float = 60.0
    weights: TokenWeights = field(default_factory=TokenWeights)
    # Used for tenants without set_limits(); unlimited unless configured.
    default_limits: TenantLimits = field(default_factory=TenantLimits)
    # A slot frees when any in-flight request ends, which we cannot predict.
    concurrency_retry_after_s: float = 1.0
    # How long an ended request id is remembered to refuse its redelivery.
    ended_ttl_s: float = 600.0


class QuotaLedger:
    def __init__(self, config: QuotaConfig | None = None) -> None:
        self.config = config or QuotaConfig()
        self._limits: dict[str, TenantLimits] = {}
        self._usage: dict[str, TenantCounters] = {}
        self._reservations: dict[str, Reservation] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()

    # ---------------------------------------------------------------- limits

    def set_limits(self, tenant_id: str, limits: TenantLimits) -> None:
        self._limits[tenant_id] = limits

    def limits_for(self, tenant_id: str) -> TenantLimits:
        return self._limits.get(tenant_id, self.config.default_limits)

    # ---------------------------------------------------------------- admission

    def reserve(self, tenant_id: str, request_id: str, tokens: int | TokenUsage, now: float) -> Admission:
        """Admit a request and reserve its estimated tokens, or say why not.

        ``tokens`` is the estimate: a :class:`TokenUsage` (prompt, max_tokens) is
        weighted with the configured weights; an ``int`` is taken as quota tokens.
        Reserving an id that is already reserved returns the existing admission
        without counting it twice.
        """
        amount = self.config.weights.quota_tokens(tokens)
        usage = self._tenant(tenant_id, now)
        self._forget_old_ended(now)
        existing = self._reservations.get(request_id)
        if existing is not None:
            return Admission(True, existing.tenant_id, request_id, existing.tokens,
                             self._snapshot(existing.tenant_id, now))
        if request_id in self._ended:
            return Admission(False, tenant_id, request_id, 0, self._snapshot(tenant_id, now),
                             RejectReason.DUPLICATE_REQUEST, None)

        rejection = self._first_violation(tenant_id, usage, amount, now)
        if rejection is not None:
            reason, retry_after = rejection
            return Admission(False, tenant_id, request_id, 0, self._snapshot(tenant_id, now), reason, retry_after)

        self._reservations[request_id] = Reservation(request_id, tenant_id, amount, usage.window_start, usage.month)
        usage.window_requests += 1
        usage.window_reserved += amount
        usage.month_reserved += amount
        usage.in_flight_tokens += amount
        usage.in_flight_count += 1
        return Admission(True, tenant_id, request_id, amount, self._snapshot(tenant_id, now))

    def grow(self, request_id: str, tokens: int | TokenUsage, now: float) -> Admission:
        """Raise an open reservation to ``tokens`` (its size once known, e.g. after tokenizing).
        The request and its concurrency slot were counted when it was reserved; only the token
        limits are checked for the difference. A refused growth changes nothing."""
        reservation = self._reservations.get(request_id)
        if reservation is None:
            raise KeyError(f"no open reservation {request_id!r}")
        amount = self.config.weights.quota_tokens(tokens)
        extra = amount - reservation.tokens
        tenant_id = reservation.tenant_id
        usage = self._tenant(tenant_id, now)
        if extra > 0:
            limits = self.limits_for(tenant_id)
            budget, tpm = limits.monthly_token_budget, limits.tokens_per_minute
            if budget is not None and usage.month_tokens() + extra > budget:
                return Admission(False, tenant_id, request_id, reservation.tokens, self._snapshot(tenant_id, now),
                                 RejectReason.MONTHLY_BUDGET_EXCEEDED, max(0.0, next_month_start(now) - now))
            if tpm is not None and usage.tokens_in_window() + extra > tpm:
                return Admission(False, tenant_id, request_id, reservation.tokens, self._snapshot(tenant_id, now),
                                 RejectReason.RATE_LIMIT_TOKENS,
                                 None if amount > tpm else self._window_reset(usage, now))
        reservation.tokens = amount
        if reservation.window_start == usage.window_start:
            usage.window_reserved += extra
        if reservation.month == usage.month:
            usage.month_reserved += extra
        usage.in_flight_tokens += extra
        return Admission(True, tenant_id, request_id, amount, self._snapshot(tenant_id, now))

    def count_request(self, tenant_id: str, now: float) -> Admission:
        """Count one request that reserves nothing (a read: a stored object's lookup, a listing) against
        requests-per-minute, or say why not. It takes no concurrency slot and no tokens and leaves nothing
        to settle, so a tenant at its concurrency or token limit can still read what it has."""
        usage = self._tenant(tenant_id, now)
        rpm = self.limits_for(tenant_id).requests_per_minute
        if rpm is not None and usage.requests_in_window() + 1 > rpm:
            return Admission(False, tenant_id, "", 0, self._snapshot(tenant_id, now),
                             RejectReason.RATE_LIMIT_REQUESTS, self._window_reset(usage, now))
        usage.window_requests += 1
        return Admission(True, tenant_id, "", 0, self._snapshot(tenant_id, now))

    def _first_violation(
        self, tenant_id: str, usage: TenantCounters, amount: int, now: float
    ) -> tuple[RejectReason, float | None] | None:
        # Checked longest wait first, so retry_after never invites a retry that a
        # later check would refuse anyway.
        limits = self.limits_for(tenant_id)
        reset = self._window_reset(usage, now)
        budget = limits.monthly_token_budget
        if budget is not None and usage.month_tokens() + amount > budget:
            return RejectReason.MONTHLY_BUDGET_EXCEEDED, max(0.0, next_month_start(now) - now)
        rpm = limits.requests_per_minute
        if rpm is not None and usage.requests_in_window() + 1 > rpm:
            return RejectReason.RATE_LIMIT_REQUESTS, reset
        tpm = limits.tokens_per_minute
        if tpm is not None and usage.tokens_in_window() + amount > tpm:
            return RejectReason.RATE_LIMIT_TOKENS, (None if amount > tpm else reset)
        cap = limits.max_concurrent
        if cap is not None and usage.in_flight_count + 1 > cap:
            return RejectReason.CONCURRENCY_LIMIT, self.config.concurrency_retry_after_s
        return None

    # ---------------------------------------------------------------- ending

    def settle(self, request_id: str, actual_tokens: int | TokenUsage, now: float) -> bool:
        """Replace the reservation by the actual usage. Returns ``False`` (no-op) for
        an unknown or already ended request id."""
        reservation = self._reservations.pop(request_id, None)
        if reservation is None:
            return False
        actual = self.config.weights.quota_tokens(actual_tokens)
        usage = self._tenant(reservation.tenant_id, now)
        usage.in_flight_tokens -= reservation.tokens
        usage.in_flight_count -= 1
        # Usage counts in the window/month of admission; if that has already rolled
        # over there is nothing left to correct.
        if reservation.window_start == usage.window_start:
            usage.window_reserved -= reservation.tokens
            usage.window_used += actual
        if reservation.month == usage.month:
            usage.month_reserved -= reservation.tokens
            usage.month_used += actual
        self._ended[request_id] = now
        self._forget_old_ended(now)
        return True

    def release(self, request_id: str, now: float) -> bool:
        """Drop the reservation of a request that used nothing (cancelled, shed,
        failed, timed out). Its admission still counts against requests-per-minute.
        If it consumed tokens before failing, call :meth:`settle` instead."""
        return self.settle(request_id, 0, now)

    def _forget_old_ended(self, now: float) -> None:
        horizon = now - self.config.ended_ttl_s
        while self._ended:
            request_id, ended_at = next(iter(self._ended.items()))
            if ended_at >= horizon:
                break
            del self._ended[request_id]

    # ---------------------------------------------------------------- views

    def in_flight(self, tenant_id: str) -> tuple[int, int]:
        """(reserved tokens, concurrent requests) not yet settled or released."""
        usage = self._usage.get(tenant_id)
        return (usage.in_flight_tokens, usage.in_flight_count) if usage else (0, 0)

    def snapshot(self, tenant_id: str, now: float) -> RateLimitSnapshot:
        """Current header numbers, e.g. for a successful response."""
        self._tenant(tenant_id, now)
        return self._snapshot(tenant_id, now)

    def _snapshot(self, tenant_id: str, now: float) -> RateLimitSnapshot:
        usage = self._usage[tenant_id]
        limits = self.limits_for(tenant_id)
        reset = self._window_reset(usage, now)
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        return RateLimitSnapshot(
            rpm, None if rpm is None else max(0, rpm - usage.requests_in_window()), reset,
            tpm, None if tpm is None else max(0, tpm - usage.tokens_in_window()), reset,
        )

    def _window_reset(self, usage: TenantCounters, now: float) -> float:
        return min(self.config.window_s, max(0.0, usage.window_start + self.config.window_s - now))

    def usage(self, tenant_id: str, now: float) -> QuotaUsage:
        """What this ledger counts for the tenant now (to publish from streams)."""
        usage = self._tenant(tenant_id, now)
        return QuotaUsage(tenant_id, usage.window_start, usage.requests_in_window(),
                          usage.tokens_in_window(), usage.month, usage.month_tokens(), now)

    # ---------------------------------------------------------------- saved piecewise

    # The counters are flat (numbers and strings), so a copy of their fields is what asdict would
    # give, at a fraction of its cost (streams saves them for every request, twice).
    def tenant_state(self, tenant_id: str) -> dict[str, Any] | None:
        """The tenant's counters as ``to_dict`` saves them under ``usage``, or None if it has none."""
        usage = self._usage.get(tenant_id)
        return dict(vars(usage)) if usage is not None else None

    def reservation_state(self, request_id: str) -> dict[str, Any] | None:
        """The open reservation as ``to_dict`` saves it under ``reservations``, or None."""
        reservation = self._reservations.get(request_id)
        return dict(vars(reservation)) if reservation is not None else None

    def is_open(self, request_id: str) -> bool:
        return request_id in self._reservations

    def tenants(self) -> list[str]:
        return list(self._usage)

    # ---------------------------------------------------------------- remote view

    def apply_remote_usage(
        self,
        tenant_id: str,
        used_tokens_in_window: int,
        used_requests_in_window: int,
        month_used: int,
        as_of: float,
    ) -> bool:
        """Merge the authoritative counts published by streams (a :class:`QuotaUsage`:
        settled + reserved tokens and admitted requests for the window containing
        ``as_of``, and the month's tokens).

        The remote numbers already contain whatever of our own traffic streams had
        seen, so we keep only the part beyond our local counts at this moment:
        ``extra = max(0, remote - local)``; from then on the effective count is
        ``local + extra``. Our admissions that streams had not yet seen are thus
        counted once, at the price of briefly under-counting other processes' usage by
        at most what arrived during the publication lag. Updates older than the last
        one applied are ignored (returns ``False``), as are window parts for a window
        that has already rolled over locally.
        """
        usage = self._tenant(tenant_id, as_of)
        if usage.remote_as_of is not None and as_of < usage.remote_as_of:
            return False
        usage.remote_as_of = as_of
        if window_start(as_of, self.config.window_s) == usage.window_start:
            usage.remote_window_start = usage.window_start
            usage.remote_extra_requests = max(0, used_requests_in_window - usage.window_requests)
            usage.remote_extra_tokens = max(0, used_tokens_in_window - usage.window_used - usage.window_reserved)
        if month_key(as_of) == usage.month:
            usage.remote_month = usage.month
            usage.remote_extra_month = max(0, month_used - usage.month_used - usage.month_reserved)
        return True

    # ---------------------------------------------------------------- internals

    def _tenant(self, tenant_id: str, now: float) -> TenantCounters:
        """The tenant's counters, rolled forward to the window/month of ``now``.
        Never rolled backwards: a slightly stale ``now`` counts in the current window."""
        ws, month = window_start(now, self.config.window_s), month_key(now)
        usage = self._usage.get(tenant_id)
        if usage is None:
            usage = self._usage[tenant_id] = TenantCounters(ws, month)
        if ws > usage.window_start:
            usage.window_start = ws
            usage.window_requests = usage.window_used = usage.window_reserved = 0
        if month > usage.month:
            usage.month = month
            usage.month_used = usage.month_reserved = 0
        return usage

    # ---------------------------------------------------------------- persistence

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "limits": {t: lim.to_dict() for t, lim in self._limits.items()},
            "usage": {t: asdict(u) for t, u in self._usage.items()},
            "reservations": [asdict(r) for r in self._reservations.values()],
            "ended": [[r, t] for r, t in self._ended.items()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], config: QuotaConfig | None = None) -> QuotaLedger:
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported quota state version {data.get('version')!r}")
        ledger = cls(config)
        ledger._limits = {t: TenantLimits.from_dict(d) for t, d in data["limits"].items()}
        ledger._usage = {t: TenantCounters(**d) for t, d in data["usage"].items()}
        ledger._reservations = {r["request_id"]: Reservation(**r) for r in data["reservations"]}
        ledger._ended = OrderedDict((r, float(t)) for r, t in data["ended"])
        return ledger
