"""The numbers behind OpenAI's x-ratelimit-* response headers, and how their reset times are written."""
from __future__ import annotations

import math
from dataclasses import dataclass


def format_reset(seconds: float) -> str:
    """OpenAI-style duration for x-ratelimit-reset-*: ``"20ms"``, ``"7s"``, ``"6m0s"``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


@dataclass(frozen=True)
class RateLimitSnapshot:
    """The numbers behind OpenAI's x-ratelimit-* headers. ``None`` limit = unlimited."""

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.limit_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            out["x-ratelimit-reset-requests"] = format_reset(self.reset_requests_s)
        if self.limit_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            out["x-ratelimit-reset-tokens"] = format_reset(self.reset_tokens_s)
        return out
