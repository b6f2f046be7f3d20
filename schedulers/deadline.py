"""Deadline shedding.

A request carries an absolute ``deadline`` (seconds, same clock as ``now``) after which
its caller no longer wants an answer. Releasing it to a GPU would burn capacity on work
nobody reads, so a request is *expired* once ``now >= deadline``, and an expired request
is never released: the queue sheds it and the caller answers its client.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ShedReason(str, Enum):
    DEADLINE_EXPIRED = "deadline_expired"


@dataclass(frozen=True)
class DeadlinePolicy:
    @staticmethod
    def is_expired(deadline: float | None, now: float) -> bool:
        return deadline is not None and now >= deadline

    def shed_reason(self, deadline: float | None, now: float) -> ShedReason | None:
        """Why a request with this deadline should be shed now, or ``None`` to keep it."""
        if self.is_expired(deadline, now):
            return ShedReason.DEADLINE_EXPIRED
        return None
