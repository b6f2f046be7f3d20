"""The dashboard's usage panels, shaped for the charts from the ledger's rows (pure; no I/O).

Every series has one value per bucket of the window, zero (or None for a latency with no finished
request) where nothing happened, so stacked charts line up and an idle hour shows as idle.
"""
from __future__ import annotations

from collections import defaultdict

OUTCOMES = ("finished", "cancelled", "failed", "shed")
LATENCIES = tuple(f"{kind}_{q}_ms" for kind in ("ttft", "tpot") for q in ("p50", "p95", "p99"))


def bucket_starts(since_ms: int, until_ms: int, width_s: int) -> list[int]:
    """The starts of the buckets that cover [since, until), aligned as ClickHouse's toStartOfInterval
    aligns them (on multiples of the width since the epoch)."""
    width = width_s * 1000
    first = since_ms // width * width
    return list(range(first, max(until_ms, first + 1), width))


def _stack(rows: list[dict], by: str, value: str, index: dict[int, int]) -> dict[str, list[float]]:
    series: dict[str, list[float]] = defaultdict(lambda: [0] * len(index))
    for r in rows:
        i = index.get(r["t_ms"])
        if i is not None:
            series[r[by]][i] += r[value]
    return dict(sorted(series.items()))


def usage_panels(usage_rows: list[dict], latency_rows: list[dict], since_ms: int, until_ms: int,
                 width_s: int) -> dict:
    buckets = bucket_starts(since_ms, until_ms, width_s)
    index = {t: i for i, t in enumerate(buckets)}
    outcomes = {name: [0] * len(buckets) for name in OUTCOMES}
    for r in usage_rows:
        i = index.get(r["t_ms"])
        if i is not None:
            for name in OUTCOMES:
                outcomes[name][i] += r[name]
    latency = {name: [None] * len(buckets) for name in LATENCIES}
    for r in latency_rows:
        i = index.get(r["t_ms"])
        if i is not None:
            for name in LATENCIES:
                latency[name][i] = r.get(name)
    totals: dict[str, dict[str, float]] = defaultdict(lambda: {"requests": 0, "tokens": 0, "cost_usd": 0.0})
    for r in usage_rows:
        t = totals[r["tenant_id"]]
        t["requests"] += r["requests"]
        t["tokens"] += r["tokens"]
        t["cost_usd"] += r["cost_usd"]
    top = [{"tenant_id": k, **v} for k, v in sorted(totals.items(), key=lambda kv: (-kv[1]["tokens"], kv[0]))]
    return {
        "since_ms": since_ms, "until_ms": until_ms, "bucket_s": width_s, "buckets": buckets,
        "tokens_by_tenant": _stack(usage_rows, "tenant_id", "tokens", index),
        "cost_by_tenant": _stack(usage_rows, "tenant_id", "cost_usd", index),
        "tokens_by_model": _stack(usage_rows, "model", "tokens", index),
        "cost_by_model": _stack(usage_rows, "model", "cost_usd", index),
        "outcomes": outcomes,
        "latency": latency,
        "top_tenants": top,
        "totals": {"requests": sum(t["requests"] for t in top), "tokens": sum(t["tokens"] for t in top),
                   "cost_usd": sum(t["cost_usd"] for t in top)},
    }
