"""What a worker holds of the requests `work` gave it: those running in the engine (one `InFlight`
each), those decoded but not started yet (pending), and the ids cancelled lately (so a record that
arrives after its cancellation is ended, not started)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, cast

from schemas.records import InferenceRequested

# Cancelled request ids remembered; the oldest is forgotten past this many.
CANCELLED_MEMORY = 10_000

# A decoded `work` record not yet in the engine: (its message, its record).
Pending = tuple[Any, InferenceRequested]


def request_id_of(record: Mapping[str, Any]) -> str:
    """A decoded record's request id. Its envelope types it nullable, but decoding checks it is there
    (schemas/checks.py) for every record a worker acts on."""
    return cast(str, record["request_id"])


def resume_of(record: InferenceRequested) -> Mapping[str, Any]:
    """Where a preempted request resumes (its tokens so far, its timings); empty for a fresh one."""
    return record.get("resume") or {}


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class InFlight:
    record: InferenceRequested
    partition: int
    offset: int
    started_at_ms: int
    first_token_at_ms: int | None = None
    completion_tokens: dict[int, int] = field(default_factory=dict)
    finished_choices: set[int] = field(default_factory=set)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    cached_tokens: int = 0
    text_chars: int = 0  # characters of choice 0 sent so far (where a preempted stream resumes)
    error: str | None = None  # why the engine ended it (its adapter could not be loaded)

    @property
    def request_id(self) -> str:
        return request_id_of(self.record)

    @property
    def reply_address(self) -> tuple[str, int]:
        return self.record["reply_topic"], self.record["reply_partition"]


class RequestBook:
    """The worker's requests by state; every part of the worker reads and changes this one book."""

    def __init__(self) -> None:
        self.in_flight: dict[str, InFlight] = {}
        self.pending: list[Pending] = []
        self.cancelled: dict[str, None] = {}  # insertion-ordered: the oldest is forgotten first

    def cancel(self, request_id: str) -> InFlight | None:
        """Remember the request as cancelled; its flight, taken out of the book, if it runs here."""
        self.cancelled[request_id] = None
        if len(self.cancelled) > CANCELLED_MEMORY:
            self.cancelled.pop(next(iter(self.cancelled)))
        return self.in_flight.pop(request_id, None)
