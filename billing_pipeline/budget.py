"""Month-to-date token usage per tenant (UTC calendar month, by request finish time).

Tokens = billable prompt tokens (cached ones included) + completion tokens, read from the
deduplicated per-minute aggregate. streams/ owns publishing quota state to `quota-state`;
it can read these numbers from the billing service: ``GET /admin/usage/month-to-date``.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

from billing_pipeline.store import Store, default_store


def month_start_s(now_s: float | None = None) -> int:
    now = datetime.fromtimestamp(time.time() if now_s is None else now_s, timezone.utc)
    return int(datetime(now.year, now.month, 1, tzinfo=timezone.utc).timestamp())


def month_to_date_detail(tenant_id: str | None = None, *, store: Store | None = None,
                         now_s: float | None = None) -> dict[str, dict]:
    """{tenant_id: {tokens, input_tokens, cached_tokens, completion_tokens, requests, cost_pusd, cost_usd}}."""
    store = store or default_store()
    where = "minute >= toDateTime({start:UInt32}, 'UTC')"
    params: dict = {"start": month_start_s(now_s)}
    if tenant_id is not None:
        where += " AND tenant_id = {tenant:String}"
        params["tenant"] = tenant_id
    rows = store.dicts(
        "SELECT tenant_id, sum(total_tokens) AS tokens, sum(input_tokens) AS input_tokens, "
        "sum(cached_tokens) AS cached_tokens, sum(completion_tokens) AS completion_tokens, "
        "sum(billable_requests) AS requests, toInt64(sum(cost_pusd)) AS cost_pusd "
        f"FROM {{db}}.usage_minute FINAL WHERE {where} GROUP BY tenant_id ORDER BY tenant_id", params)
    out = {}
    for r in rows:
        t = r.pop("tenant_id")
        r = {k: int(v) for k, v in r.items()}
        r["cost_usd"] = r["cost_pusd"] / 1e12
        out[t] = r
    if tenant_id is not None and tenant_id not in out:
        out[tenant_id] = {"tokens": 0, "input_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                          "requests": 0, "cost_pusd": 0, "cost_usd": 0.0}
    return out


def month_to_date(tenant_id: str | None = None, *, store: Store | None = None,
                  now_s: float | None = None) -> dict[str, int]:
    """{tenant_id: tokens this month}; with a tenant id, just that tenant (0 if it used nothing).
    Without ``store``, the process's default store (the billing process's own ClickHouse)."""
    return {t: d["tokens"] for t, d in month_to_date_detail(tenant_id, store=store, now_s=now_s).items()}
