import json
from datetime import datetime, timezone

import pytest

from schedulers import (
    QuotaConfig,
    QuotaLedger,
    RejectReason,
    TenantLimits,
    TokenUsage,
    TokenWeights,
    format_reset,
    month_key,
    next_month_start,
)

T0 = datetime(2025, 3, 10, 12, 0, 0, tzinfo=timezone.utc).timestamp()  # a window boundary


def ledger(**limits):
    led = QuotaLedger()
    led.set_limits("acme", TenantLimits(**limits))
    return led


def test_admits_and_reports_header_numbers():
    led = ledger(requests_per_minute=10, tokens_per_minute=1000)
    adm = led.reserve("acme", "r1", 300, T0 + 15)
    assert adm.admitted and adm.reason is None and adm.reserved_tokens == 300
    rl = adm.rate_limits
    assert (rl.limit_requests, rl.remaining_requests) == (10, 9)
    assert (rl.limit_tokens, rl.remaining_tokens) == (1000, 700)
    assert rl.reset_tokens_s == 45
    assert rl.headers() == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "45s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "700",
        "x-ratelimit-reset-tokens": "45s",
    }


def test_requests_per_minute():
    led = ledger(requests_per_minute=2)
    assert led.reserve("acme", "1", 1, T0).admitted
    assert led.reserve("acme", "2", 1, T0).admitted
    led.release("1", T0)  # a released request still counted as a request
    adm = led.reserve("acme", "3", 1, T0 + 20)
    assert adm.reason is RejectReason.RATE_LIMIT_REQUESTS and adm.retry_after_s == 40
    assert led.reserve("acme", "3", 1, T0 + 60).admitted  # next window


def test_tokens_per_minute_counts_reservations_and_settlements():
    led = ledger(tokens_per_minute=100)
    assert led.reserve("acme", "1", 80, T0).admitted
    adm = led.reserve("acme", "2", 30, T0 + 1)
    assert adm.reason is RejectReason.RATE_LIMIT_TOKENS and adm.retry_after_s == 59
    led.settle("1", 50, T0 + 2)  # the estimate was generous: 30 tokens come back
    assert led.reserve("acme", "2", 30, T0 + 3).admitted
    assert led.snapshot("acme", T0 + 3).remaining_tokens == 20


def test_request_larger_than_tpm_has_no_retry_after():
    adm = ledger(tokens_per_minute=100).reserve("acme", "1", 101, T0)
    assert adm.reason is RejectReason.RATE_LIMIT_TOKENS and adm.retry_after_s is None


def test_concurrency_limit():
    led = ledger(max_concurrent=1)
    assert led.reserve("acme", "1", 1, T0).admitted
    adm = led.reserve("acme", "2", 1, T0)
    assert adm.reason is RejectReason.CONCURRENCY_LIMIT and adm.retry_after_s == 1.0
    led.settle("1", 1, T0)
    assert led.reserve("acme", "2", 1, T0).admitted


def test_monthly_budget():
    led = ledger(monthly_token_budget=1000)
    end_of_month = datetime(2025, 3, 31, 23, 59, 0, tzinfo=timezone.utc).timestamp()
    assert led.reserve("acme", "1", 900, end_of_month).admitted
    adm = led.reserve("acme", "2", 200, end_of_month + 30)
    assert adm.reason is RejectReason.MONTHLY_BUDGET_EXCEEDED
    assert adm.retry_after_s == 30
    assert led.reserve("acme", "2", 200, end_of_month + 60).admitted  # April


def test_monthly_budget_reported_before_rate_limits():
    led = ledger(monthly_token_budget=10, tokens_per_minute=5, requests_per_minute=0)
    assert led.reserve("acme", "1", 20, T0).reason is RejectReason.MONTHLY_BUDGET_EXCEEDED


def test_settle_and_release_are_idempotent():
    led = ledger(tokens_per_minute=100)
    led.reserve("acme", "1", 60, T0)
    led.reserve("acme", "2", 30, T0)
    assert led.in_flight("acme") == (90, 2)
    assert led.settle("1", 40, T0 + 1) is True
    assert led.settle("1", 40, T0 + 1) is False
    assert led.release("1", T0 + 1) is False
    assert led.release("2", T0 + 1) is True
    assert led.release("2", T0 + 1) is False
    assert led.release("unknown", T0) is False
    assert led.in_flight("acme") == (0, 0)
    assert led.snapshot("acme", T0 + 2).remaining_tokens == 60


def test_redelivered_reserve_is_not_counted_twice():
    led = ledger(tokens_per_minute=100)
    assert led.reserve("acme", "1", 60, T0).admitted
    again = led.reserve("acme", "1", 60, T0)
    assert again.admitted and led.in_flight("acme") == (60, 1)
    led.settle("1", 60, T0)
    late = led.reserve("acme", "1", 60, T0 + 1)
    assert late.reason is RejectReason.DUPLICATE_REQUEST
    assert led.in_flight("acme") == (0, 0)


def test_reservation_from_previous_window_settles_without_touching_new_window():
    led = ledger(tokens_per_minute=100)
    assert led.reserve("acme", "long", 90, T0 + 59).admitted
    assert led.reserve("acme", "new", 100, T0 + 60).admitted  # new window is empty
    led.settle("long", 90, T0 + 70)
    assert led.snapshot("acme", T0 + 70).remaining_tokens == 0
    assert led.in_flight("acme") == (100, 1)


def test_token_weights_apply_to_usage():
    weights = TokenWeights(input=1, output=3, cached_input=0.1)
    led = QuotaLedger(QuotaConfig(weights=weights))
    adm = led.reserve("acme", "1", TokenUsage(prompt_tokens=100, completion_tokens=10), T0)
    assert adm.reserved_tokens == 130
    led.settle("1", TokenUsage(prompt_tokens=100, completion_tokens=5, cached_prompt_tokens=30), T0)
    assert led.usage("acme", T0).used_tokens_in_window == 70 + 3 + 15
    assert weights.quota_tokens(TokenUsage(0, 0, 0)) == 0
    with pytest.raises(ValueError):
        TokenUsage(10, 0, 11)


def test_remote_usage_adds_other_processes_traffic():
    authority = ledger(tokens_per_minute=1000, requests_per_minute=100)
    edge = ledger(tokens_per_minute=1000, requests_per_minute=100)
    # Traffic admitted through another edge process, seen by the authority.
    authority.reserve("acme", "other", 600, T0 + 1)
    authority.settle("other", 500, T0 + 2)
    # This edge's own request, seen by both.
    authority.reserve("acme", "mine", 200, T0 + 3)
    edge.reserve("acme", "mine", 200, T0 + 3)
    u = authority.usage("acme", T0 + 4)
    assert edge.apply_remote_usage("acme", u.used_tokens_in_window, u.used_requests_in_window, u.month_used, u.as_of)
    snap = edge.snapshot("acme", T0 + 5)
    assert snap.remaining_tokens == 1000 - 700  # 500 other + 200 mine, mine counted once
    assert snap.remaining_requests == 100 - 2
    assert edge.reserve("acme", "x", 301, T0 + 5).reason is RejectReason.RATE_LIMIT_TOKENS
    # Stale updates are ignored; a new window forgets the old remote numbers.
    assert not edge.apply_remote_usage("acme", 0, 0, 0, T0 + 3)
    assert edge.snapshot("acme", T0 + 61).remaining_tokens == 1000
    edge.settle("mine", 200, T0 + 62)
    assert edge.in_flight("acme") == (0, 0)


def test_remote_month_usage():
    edge = ledger(monthly_token_budget=1000)
    edge.apply_remote_usage("acme", 0, 0, 950, T0)
    assert edge.reserve("acme", "1", 60, T0 + 1).reason is RejectReason.MONTHLY_BUDGET_EXCEEDED
    assert edge.reserve("acme", "1", 50, T0 + 1).admitted


def test_round_trip():
    led = ledger(tokens_per_minute=100, max_concurrent=3)
    led.reserve("acme", "1", 40, T0)
    led.reserve("acme", "2", 40, T0)
    led.settle("2", 10, T0)
    led.apply_remote_usage("acme", 70, 3, 70, T0 + 1)
    restored = QuotaLedger.from_dict(json.loads(json.dumps(led.to_dict())))
    assert restored.to_dict() == led.to_dict()
    for x in (led, restored):
        assert x.reserve("acme", "3", 31, T0 + 2).reason is RejectReason.RATE_LIMIT_TOKENS
        assert x.reserve("acme", "3", 30, T0 + 2).admitted
        assert x.reserve("acme", "2", 1, T0 + 2).reason is RejectReason.DUPLICATE_REQUEST
        x.release("1", T0 + 3)
        x.settle("3", 5, T0 + 3)
        assert x.in_flight("acme") == (0, 0)
    assert restored.to_dict() == led.to_dict()


def test_time_helpers():
    assert month_key(T0) == "2025-03"
    assert next_month_start(T0) == datetime(2025, 4, 1, tzinfo=timezone.utc).timestamp()
    dec = datetime(2025, 12, 31, 23, tzinfo=timezone.utc).timestamp()
    assert next_month_start(dec) == datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()
    assert format_reset(0.02) == "20ms"
    assert format_reset(6.2) == "7s"
    assert format_reset(360) == "6m0s"
    assert format_reset(3725) == "1h2m5s"


def test_a_reservation_taken_before_its_size_is_known_grows_within_the_token_limits():
    led = ledger(requests_per_minute=10, tokens_per_minute=100, max_concurrent=2)
    assert led.reserve("acme", "1", 0, T0).admitted  # counted as a request and a slot at once
    assert led.in_flight("acme") == (0, 1)
    assert led.grow("1", 60, T0 + 1).admitted
    assert led.in_flight("acme") == (60, 1)
    assert led.reserve("acme", "2", 0, T0 + 1).admitted
    refused = led.grow("2", 50, T0 + 2)  # 60 + 50 > 100
    assert refused.reason is RejectReason.RATE_LIMIT_TOKENS and refused.retry_after_s == 58
    assert led.in_flight("acme") == (60, 2)  # a refused growth changes nothing
    led.release("2", T0 + 2)
    assert led.reserve("acme", "3", 0, T0 + 2).admitted  # the slot came back, the request still counts
    assert led.snapshot("acme", T0 + 2).remaining_requests == 7
    with pytest.raises(KeyError):
        led.grow("never-reserved", 5, T0)
