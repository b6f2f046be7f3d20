"""Token usage and how it is weighted into quota tokens.

Quota is counted in integer *quota tokens*. Input, output and cached-input tokens may
be priced differently (configuration), so usage is converted with
:class:`TokenWeights`. The result is rounded **up** to an integer with exact rational
arithmetic: integers keep reservation bookkeeping exact (in-flight totals return to
exactly zero), and rounding up never under-counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class TokenUsage:
    """Token counts as OpenAI reports them: ``cached_prompt_tokens`` is the part of
    ``prompt_tokens`` served from the prefix cache (it is included in prompt_tokens)."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.prompt_tokens, self.completion_tokens, self.cached_prompt_tokens) < 0:
            raise ValueError("token counts must be >= 0")
        if self.cached_prompt_tokens > self.prompt_tokens:
            raise ValueError("cached_prompt_tokens cannot exceed prompt_tokens")


@dataclass(frozen=True)
class TokenWeights:
    input: float = 1.0
    output: float = 1.0
    cached_input: float = 1.0

    def __post_init__(self) -> None:
        if min(self.input, self.output, self.cached_input) < 0:
            raise ValueError("token weights must be >= 0")

    def quota_tokens(self, usage: TokenUsage | int) -> int:
        """Weighted integer tokens. A plain ``int`` is taken as already weighted."""
        if isinstance(usage, int):
            if usage < 0:
                raise ValueError("tokens must be >= 0")
            return usage
        # Fraction(str(w)) reads 0.1 as exactly 1/10, so 30 * 0.1 is exactly 3.
        uncached = usage.prompt_tokens - usage.cached_prompt_tokens
        total = (
            uncached * Fraction(str(self.input))
            + usage.cached_prompt_tokens * Fraction(str(self.cached_input))
            + usage.completion_tokens * Fraction(str(self.output))
        )
        return math.ceil(total)
