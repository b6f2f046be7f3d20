"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from .token_constraint import ConstraintFactory

MIN_DIVISOR = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    # Structured output: makes each choice's constraint (token_constraint.py); None = unconstrained.
    constraint: ConstraintFactory | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(self.stop_token_ids)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        # Logits are float32: dividing by a temperature or penalty this small overflows them to inf, and then
        # the softmax is NaN (a constrained request then samples a token its grammar forbids). A temperature
        # this close to 0 is greedy decoding, as vLLM reads it; a penalty this small is held at the bound.
        if self.temperature < MIN_DIVISOR:
            self.temperature = 0.0
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        self.repetition_penalty = max(self.repetition_penalty, MIN_DIVISOR)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
