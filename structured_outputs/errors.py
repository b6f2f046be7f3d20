"""What a structured-output request can be refused with (both carry the request field to blame)."""
from __future__ import annotations


class GrammarError(ValueError):
    """A spec that cannot be compiled; ``param`` names the request field to blame."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param
        self.expires_at: float | None = None  # a refusal remembered only until then (monotonic), if set


class GrammarBusy(GrammarError):
    """Too many schemas are compiling already: try again shortly (not the spec's fault)."""
