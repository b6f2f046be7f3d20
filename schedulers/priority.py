"""Priority classes and aging.

Two classes exist: ``interactive`` (a person is waiting on the answer) and ``batch``
(throughput work that tolerates delay). Interactive is served first, but a strict
priority would let a steady interactive load starve batch forever, so a batch request
*ages*: once it has waited ``batch_aging_s`` seconds it competes in the interactive
tier. Aging is a step, not a slope, because the fair queue orders requests inside a
tier by tenant fairness (VTC), not by wait time; a request only needs to know which
tier it is in.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PriorityClass(str, Enum):
    """A request's declared class. The string value is the wire/config name."""

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """Lower rank is served first."""
        return _RANKS[self]


_RANKS = {PriorityClass.INTERACTIVE: 0, PriorityClass.BATCH: 1}


class InvalidPriorityClass(ValueError):
    """Raised for a class name that is not one of :class:`PriorityClass`."""


def parse_priority(
    value: str | PriorityClass | None,
    default: PriorityClass = PriorityClass.INTERACTIVE,
) -> PriorityClass:
    """Turn a user/config supplied class name into a :class:`PriorityClass`.

    ``None`` or an empty string means "not given" and yields ``default``. Names are
    matched case-insensitively after stripping whitespace, because they come from
    HTTP headers and JSON bodies written by hand. Anything else raises
    :class:`InvalidPriorityClass` (the edge answers 400, it must not silently guess).
    """
    if value is None:
        return default
    if isinstance(value, PriorityClass):
        return value
    if not isinstance(value, str):
        raise InvalidPriorityClass(f"priority class must be a string, got {type(value).__name__}")
    name = value.strip().lower()
    if not name:
        return default
    try:
        return PriorityClass(name)
    except ValueError:
        valid = ", ".join(p.value for p in PriorityClass)
        raise InvalidPriorityClass(f"unknown priority class {value!r}; expected one of: {valid}") from None


@dataclass(frozen=True)
class AgingPolicy:
    """When a queued batch request starts competing as interactive."""

    batch_aging_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.batch_aging_s >= 0:
            raise ValueError("batch_aging_s must be >= 0")

    def is_aged(self, enqueued_at: float, now: float) -> bool:
        return now - enqueued_at >= self.batch_aging_s

    def effective_priority(self, declared: PriorityClass, enqueued_at: float, now: float) -> PriorityClass:
        """The tier a request competes in right now."""
        if declared is PriorityClass.BATCH and self.is_aged(enqueued_at, now):
            return PriorityClass.INTERACTIVE
        return declared
