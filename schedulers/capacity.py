"""Capacity credits advertised by GPU workers.

Workers publish how much more they can take (free sequence slots and, optionally, free
KV-cache tokens). The fair queue only releases a request when the credits cover it,
then debits them, so the ``work`` topic never holds more than the pool can start.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schedulers.fair_queue import QueuedRequest


@dataclass
class CapacityCredits:
    """Mutable credit balance; ``tokens=None`` means only slots are limited."""

    requests: int
    tokens: int | None = None

    def can_start(self, request: QueuedRequest) -> bool:
        if self.requests < 1:
            return False
        return self.tokens is None or request.cost_tokens <= self.tokens

    def take(self, request: QueuedRequest) -> None:
        if not self.can_start(request):
            raise ValueError(f"credits do not cover request {request.request_id}")
        self.requests -= 1
        if self.tokens is not None:
            self.tokens -= request.cost_tokens
