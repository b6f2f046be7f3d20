"""What the fair queue takes in and gives back: a queued request, its release, its shedding, a refusal."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schedulers.charges import Charge
from schedulers.deadline import ShedReason
from schedulers.priority import PriorityClass, parse_priority


@dataclass(frozen=True)
class QueuedRequest:
    """One request waiting for GPU capacity. ``payload`` is opaque to the queue
    (it must be JSON-serialisable if the queue state is persisted)."""

    request_id: str
    tenant_id: str
    priority: PriorityClass
    prompt_tokens: int
    max_tokens: int
    enqueued_at: float
    weight: float = 1.0
    deadline: float | None = None
    payload: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority", parse_priority(self.priority))
        if self.prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not self.weight > 0:
            raise ValueError("tenant weight must be > 0")

    @property
    def cost_tokens(self) -> int:
        """Token cost estimate used for capacity: the whole prompt plus the longest
        possible completion."""
        return self.prompt_tokens + self.max_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "priority": self.priority.value,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "enqueued_at": self.enqueued_at,
            "weight": self.weight,
            "deadline": self.deadline,
            "payload": self.payload,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QueuedRequest:
        return cls(**{k: data[k] for k in _REQUEST_FIELDS if k in data})


_REQUEST_FIELDS = (
    "request_id", "tenant_id", "priority", "prompt_tokens", "max_tokens",
    "enqueued_at", "weight", "deadline", "payload",
)


@dataclass(frozen=True)
class Release:
    """The result of :meth:`FairQueue.pop_next`: the request, what was charged for it,
    and the tier it won in (``interactive`` for an aged batch request)."""

    request: QueuedRequest
    charge: Charge
    tier: PriorityClass
    seq: int = -1  # its place in enqueue order (where it goes back if it is preempted)


@dataclass(frozen=True)
class ShedRequest:
    request: QueuedRequest
    reason: ShedReason


class QueueFull(Exception):
    """The tenant's queue is at its cap; the edge should answer 429 at once."""

    def __init__(self, tenant_id: str, kind: str, depth: int, limit: int) -> None:
        super().__init__(f"queue full for tenant {tenant_id!r}: {kind} {depth} >= limit {limit}")
        self.tenant_id = tenant_id
        self.kind = kind  # "requests" or "tokens"
        self.depth = depth
        self.limit = limit
