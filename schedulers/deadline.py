"""Deadline shedding.

A request carries an absolute ``deadline`` (seconds, same clock as ``now``) after which
its caller no longer wants an answer. Releasing it to a GPU would burn capacity on work
nobody reads, so:

* a request is *expired* once ``now >= deadline``; an expired request is never released;
* a request is *unreachable* once ``now + expected_wait_s >= deadline``: it is still
  valid, but given how long requests currently wait before a GPU picks them up it
  cannot start in time. Shedding it early lets the client get its 504/429 now instead
  of at the deadline. ``expected_wait_s = 0`` turns early shedding off.

The expected wait is a knob (streams can feed a measured value), not something this
module estimates, because estimating it needs observations over time (I/O-free code
gets them passed in).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ShedReason(str, Enum):
    DEADLINE_EXPIRED = "deadline_expired"
    DEADLINE_UNREACHABLE = "deadline_unreachable"


@dataclass(frozen=True)
class DeadlinePolicy:
    expected_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.expected_wait_s >= 0:
            raise ValueError("expected_wait_s must be >= 0")

    @staticmethod
    def is_expired(deadline: float | None, now: float) -> bool:
        return deadline is not None and now >= deadline

    def shed_reason(
        self, deadline: float | None, now: float, expected_wait_s: float | None = None
    ) -> ShedReason | None:
        """Why a request with this deadline should be shed now, or ``None`` to keep it."""
        if deadline is None:
            return None
        if now >= deadline:
            return ShedReason.DEADLINE_EXPIRED
        wait = self.expected_wait_s if expected_wait_s is None else expected_wait_s
        if wait > 0 and now + wait >= deadline:
            return ShedReason.DEADLINE_UNREACHABLE
        return None
