"""The dashboard's series: one value per bucket, stacked by tenant and model, gaps kept as gaps."""
from billing_pipeline.analytics import bucket_width_s
from billing_pipeline.dashboard.panels import bucket_starts, usage_panels

MIN = 60_000


def usage_row(t_ms, tenant, model="m", tokens=10, cost=0.5, finished=1, cancelled=0, failed=0, shed=0):
    return {"t_ms": t_ms, "tenant_id": tenant, "model": model, "requests": finished + cancelled + failed,
            "tokens": tokens, "cost_usd": cost, "finished": finished, "cancelled": cancelled, "failed": failed,
            "shed": shed}


def test_bucket_width_keeps_a_window_under_the_point_limit():
    assert bucket_width_s(0, 15 * MIN) == 60
    assert bucket_width_s(0, 24 * 60 * MIN) == 900
    assert bucket_width_s(0, 30 * 24 * 60 * MIN) == 6 * 3600
    for span_min in (1, 59, 600, 6000, 60000, 600000):
        width = bucket_width_s(0, span_min * MIN)
        assert span_min * 60 / width <= 120 or width == 7 * 86400


def test_bucket_starts_cover_the_window_aligned_to_the_width():
    starts = bucket_starts(7 * MIN + 5, 17 * MIN, 300)
    assert starts == [5 * MIN, 10 * MIN, 15 * MIN]


def test_series_are_stacked_per_tenant_and_model_with_zeros_where_idle():
    rows = [usage_row(0, "a", "m1", tokens=5), usage_row(0, "b", "m1", tokens=7),
            usage_row(2 * MIN, "a", "m2", tokens=3, cancelled=1, finished=0),
            usage_row(99 * MIN, "a", tokens=1000)]  # outside the window: dropped
    p = usage_panels(rows, [], 0, 3 * MIN, 60)
    assert p["buckets"] == [0, MIN, 2 * MIN]
    assert p["tokens_by_tenant"] == {"a": [5, 0, 3], "b": [7, 0, 0]}
    assert p["tokens_by_model"] == {"m1": [12, 0, 0], "m2": [0, 0, 3]}
    assert p["outcomes"]["finished"] == [2, 0, 0] and p["outcomes"]["cancelled"] == [0, 0, 1]
    assert [t["tenant_id"] for t in p["top_tenants"]][0] == "a"


def test_latency_gaps_stay_empty():
    latency = [{"t_ms": MIN, "requests": 3, "ttft_p50_ms": 12.0, "ttft_p95_ms": 20.0, "ttft_p99_ms": 21.0,
                "tpot_p50_ms": 4.0, "tpot_p95_ms": 5.0, "tpot_p99_ms": 6.0}]
    p = usage_panels([], latency, 0, 3 * MIN, 60)
    assert p["latency"]["ttft_p50_ms"] == [None, 12.0, None]
    assert p["latency"]["tpot_p99_ms"] == [None, 6.0, None]
    assert p["totals"] == {"requests": 0, "tokens": 0, "cost_usd": 0}
