"""Scheduling and quota policy for tokenmill: pure code, no I/O, time passed in as ``now``.

See docs/schedulers.md for the policies, formulas and invariants.
"""
from schedulers.deadline import DeadlinePolicy, ShedReason
from schedulers.charges import Charge
from schedulers.fair_queue import FairQueue, FairQueueConfig
from schedulers.priority import AgingPolicy, InvalidPriorityClass, PriorityClass, parse_priority
from schedulers.queue_records import QueuedRequest, QueueFull, Release, ShedRequest
from schedulers.quota import (
    Admission,
    QuotaConfig,
    QuotaLedger,
    QuotaUsage,
    RejectReason,
    TenantLimits,
)
from schedulers.rate_limit_headers import RateLimitSnapshot, format_reset
from schedulers.token_usage import TokenUsage, TokenWeights
from schedulers.windows import month_key, next_month_start, window_start

__all__ = [
    "Admission",
    "AgingPolicy",
    "Charge",
    "DeadlinePolicy",
    "FairQueue",
    "FairQueueConfig",
    "InvalidPriorityClass",
    "PriorityClass",
    "QueueFull",
    "QueuedRequest",
    "QuotaConfig",
    "QuotaLedger",
    "QuotaUsage",
    "RateLimitSnapshot",
    "RejectReason",
    "Release",
    "ShedReason",
    "ShedRequest",
    "TenantLimits",
    "TokenUsage",
    "TokenWeights",
    "format_reset",
    "month_key",
    "next_month_start",
    "parse_priority",
    "window_start",
]
