"""What a worker bills for a request that ends before it runs there (cancelled or shed while waiting
to start): a resumed, preempted request still counts the tokens its client already got."""
from __future__ import annotations

from gpu_consumers.replies import usage_event
from tests.streams.test_streams_gate import request


def completed_event(record: dict, status: str) -> dict:
    usage, _tpot = usage_event(record, status, "completion-test", None, status)
    return usage


def test_a_resumed_request_cancelled_before_it_restarts_is_billed_for_what_it_streamed():
    record = dict(request("a", max_tokens=64), resume={
        "completion_token_ids": list(range(28)), "text_chars": 90, "started_at_ms": 1_000,
        "first_token_at_ms": 1_200, "cached_tokens": 16})
    usage = completed_event(record, "cancelled")
    assert usage["status"] == "cancelled"
    assert usage["completion_tokens"] == 28 and usage["cached_tokens"] == 16
    assert usage["started_at_ms"] == 1_000 and usage["first_token_at_ms"] == 1_200


def test_a_fresh_request_that_never_ran_is_billed_no_completion():
    usage = completed_event(request("a"), "shed")
    assert usage["completion_tokens"] == 0 and usage["first_token_at_ms"] is None
