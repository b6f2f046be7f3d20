"""What a client reads when a request is refused for a policy reason, by reason code. The edge
(ingress) and the gate (streams) refuse for the same reasons and say the same thing."""
from __future__ import annotations

REJECTION_MESSAGES = {
    "rate_limit_requests": "Rate limit reached for requests per minute.",
    "rate_limit_tokens": "Rate limit reached for tokens per minute.",
    "concurrency_limit": "Too many concurrent requests for this tenant.",
    "monthly_budget_exceeded": "The tenant's monthly token budget is used up.",
    "queue_full": "Too many requests of this tenant are already waiting.",
    "duplicate_request": "This request id was already used.",
    "tenant_disabled": "This tenant is disabled.",
}


def rejection_message(reason: str) -> str:
    return REJECTION_MESSAGES.get(reason, "Rate limit reached.")
