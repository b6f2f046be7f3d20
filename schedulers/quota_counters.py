"""What the quota ledger counts: one open reservation, and one tenant's counters for its current
window and month (with the part of the authoritative ledger's count that this one did not see)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Reservation:
    request_id: str
    tenant_id: str
    tokens: int
    window_start: float
    month: str


@dataclass
class TenantCounters:
    window_start: float
    month: str
    window_requests: int = 0  # admitted in this window (released ones still count)
    window_used: int = 0  # settled tokens of requests admitted in this window
    window_reserved: int = 0  # in-flight reservations admitted in this window
    month_used: int = 0
    month_reserved: int = 0
    in_flight_tokens: int = 0  # all in-flight reservations, whatever their window
    in_flight_count: int = 0
    # Remote view: usage the authoritative ledger saw beyond our own, per window/month.
    remote_as_of: float | None = None
    remote_window_start: float | None = None
    remote_extra_requests: int = 0
    remote_extra_tokens: int = 0
    remote_month: str | None = None
    remote_extra_month: int = 0

    def requests_in_window(self) -> int:
        extra = self.remote_extra_requests if self.remote_window_start == self.window_start else 0
        return self.window_requests + extra

    def tokens_in_window(self) -> int:
        extra = self.remote_extra_tokens if self.remote_window_start == self.window_start else 0
        return self.window_used + self.window_reserved + extra

    def month_tokens(self) -> int:
        extra = self.remote_extra_month if self.remote_month == self.month else 0
        return self.month_used + self.month_reserved + extra
