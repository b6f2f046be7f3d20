"""Usage analytics queries. Every function takes the Store first and returns plain JSON-able data.

Token and cost totals come from the per-minute aggregate (`usage_minute FINAL`); latency
percentiles and per-request lookups come from the deduplicated ledger (`ledger FINAL`).
Times are epoch milliseconds (UTC); ``since`` is inclusive, ``until`` exclusive.
"""
from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from typing import Any

from billing_pipeline.store import Store

BUCKETS = {"minute": "toStartOfMinute", "hour": "toStartOfHour", "day": "toStartOfDay"}
_REL = re.compile(r"^(\d+)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

# The model as its caller named it: a LoRA adapter's requests are their own line, `<base>:<adapter>`
# (OpenAI's fine-tuned model ids), in every breakdown by model; `adapter` is '' for the base model.
MODEL_ID_EXPR = "if(adapter = '', model, concat(model, ':', adapter))"
MODEL_ID = f"{MODEL_ID_EXPR} AS model_id"

SUMS = ("sum(billable_requests) AS requests, sum(total_tokens) AS tokens, sum(input_tokens) AS input_tokens, "
        "sum(cached_tokens) AS cached_tokens, sum(completion_tokens) AS completion_tokens, "
        "toInt64(sum(cost_pusd)) AS cost_pusd, sum(shed) AS shed, sum(failed) AS failed, sum(cancelled) AS cancelled")


def parse_time(value, now_ms: int | None = None) -> int | None:
    """Epoch ms from None, an int (ms), '24h'/'7d'/'30m' (ago), 'now', or an ISO date/datetime (UTC)."""
    if value is None or value == "":
        return None
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip()
    if text == "now":
        return now_ms
    if text.lstrip("-").isdigit():
        return int(text)
    m = _REL.match(text)
    if m:
        return now_ms - int(m.group(1)) * _UNIT_S[m.group(2)] * 1000
    dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def _window(column: str, since_ms: int | None, until_ms: int | None, params: dict, minute: bool = False) -> str:
    parts = []
    if since_ms is not None:
        params["since"] = since_ms // 60_000 * 60 if minute else since_ms
        parts.append(f"{column} >= " + ("toDateTime({since:UInt32}, 'UTC')" if minute
                                        else "fromUnixTimestamp64Milli({since:Int64}, 'UTC')"))
    if until_ms is not None:
        params["until"] = (until_ms + 59_999) // 60_000 * 60 if minute else until_ms
        parts.append(f"{column} < " + ("toDateTime({until:UInt32}, 'UTC')" if minute
                                       else "fromUnixTimestamp64Milli({until:Int64}, 'UTC')"))
    return " AND ".join(parts) or "1"


def _clean(rows: list[dict]) -> list[dict]:
    for r in rows:
        for k, v in list(r.items()):
            if isinstance(v, datetime):
                r[k] = int(v.replace(tzinfo=timezone.utc).timestamp() * 1000)
            elif isinstance(v, int) or (hasattr(v, "__int__") and not isinstance(v, (float, str))):
                r[k] = int(v)
        if "cost_pusd" in r:
            r["cost_usd"] = r["cost_pusd"] / 1e12
    return rows


def _named(rows: list[dict]) -> list[dict]:
    """Rows grouped by MODEL_ID, with it under the key `model`."""
    for r in rows:
        r["model"] = r.pop("model_id")
    return _clean(rows)


def tenant_totals(store: Store, tenant_id: str, since_ms: int | None = None, until_ms: int | None = None) -> dict:
    """One tenant's totals, overall and by model. Minute granularity (the window is widened to
    whole minutes)."""
    params = {"tenant": tenant_id}
    where = "tenant_id = {tenant:String} AND " + _window("minute", since_ms, until_ms, params, minute=True)
    by_model = _named(store.dicts(
        f"SELECT {MODEL_ID}, {SUMS} FROM {{db}}.usage_minute FINAL WHERE {where} GROUP BY model_id "
        "ORDER BY model_id", params))
    keys = ("requests", "tokens", "input_tokens", "cached_tokens", "completion_tokens", "cost_pusd", "shed",
            "failed", "cancelled")
    total = {k: sum(r[k] for r in by_model) for k in keys}
    total["cost_usd"] = total["cost_pusd"] / 1e12
    return {"tenant_id": tenant_id, "since_ms": since_ms, "until_ms": until_ms, "total": total,
            "by_model": by_model}


def tenant_timeseries(store: Store, tenant_id: str, bucket: str = "hour", since_ms: int | None = None,
                      until_ms: int | None = None, model: str | None = None) -> list[dict]:
    """[{t_ms, model, requests, tokens, ..., cost_usd}] per bucket ('minute' | 'hour' | 'day') and model."""
    if bucket not in BUCKETS:
        raise ValueError(f"bucket must be one of {sorted(BUCKETS)}")
    params: dict = {"tenant": tenant_id}
    where = "tenant_id = {tenant:String} AND " + _window("minute", since_ms, until_ms, params, minute=True)
    if model:
        where += f" AND {MODEL_ID_EXPR} = {{model:String}}"
        params["model"] = model
    return _named(store.dicts(
        f"SELECT {BUCKETS[bucket]}(minute) AS t_ms, {MODEL_ID}, {SUMS} FROM {{db}}.usage_minute FINAL "
        f"WHERE {where} GROUP BY t_ms, model_id ORDER BY t_ms, model_id", params))


def top_tenants(store: Store, since_ms: int | None = None, until_ms: int | None = None, limit: int = 10,
                by: str = "tokens") -> list[dict]:
    if by not in ("tokens", "cost", "requests"):
        raise ValueError("by must be tokens, cost or requests")
    order = {"tokens": "tokens", "cost": "cost_pusd", "requests": "requests"}[by]
    params: dict = {"limit": int(limit)}
    where = _window("minute", since_ms, until_ms, params, minute=True)
    return _clean(store.dicts(
        f"SELECT tenant_id, {SUMS} FROM {{db}}.usage_minute FINAL WHERE {where} GROUP BY tenant_id "
        f"ORDER BY {order} DESC, tenant_id LIMIT {{limit:UInt32}}", params))


def by_model(store: Store, since_ms: int | None = None, until_ms: int | None = None) -> list[dict]:
    params: dict = {}
    where = _window("minute", since_ms, until_ms, params, minute=True)
    return _named(store.dicts(
        f"SELECT {MODEL_ID}, {SUMS} FROM {{db}}.usage_minute FINAL WHERE {where} GROUP BY model_id "
        "ORDER BY tokens DESC", params))


def latency_by_model(store: Store, since_ms: int | None = None, until_ms: int | None = None) -> list[dict]:
    """TTFT / TPOT / queue-time percentiles (p50, p95, p99; exact) of finished requests, by model."""
    params: dict = {}
    where = "status = 'finished' AND " + _window("finished_at", since_ms, until_ms, params)
    rows = store.dicts(
        f"SELECT {MODEL_ID}, count() AS requests, "
        "quantilesExactIf(0.5, 0.95, 0.99)(ttft_ms, ttft_ms IS NOT NULL) AS ttft, "
        "quantilesExactIf(0.5, 0.95, 0.99)(tpot_ms, tpot_ms IS NOT NULL) AS tpot, "
        "quantilesExactIf(0.5, 0.95, 0.99)(queue_ms, queue_ms IS NOT NULL) AS queue "
        f"FROM {{db}}.ledger FINAL WHERE {where} GROUP BY model_id ORDER BY model_id", params)
    out = []
    for r in rows:
        item = {"model": r["model_id"], "requests": int(r["requests"])}
        for name in ("ttft", "tpot", "queue"):
            q = r[name] or []
            for label, v in zip(("p50", "p95", "p99"), q):
                item[f"{name}_{label}_ms"] = None if v != v else float(v)  # NaN when no values
        out.append(item)
    return out


def requests_in_window(store: Store, since_ms: int | None = None, until_ms: int | None = None,
                       tenant_id: str | None = None, limit: int = 1_000_000) -> list[dict]:
    """Ledger rows (deduplicated) of requests that arrived in the window."""
    params: dict = {"limit": int(limit)}
    where = _window("arrived_at", since_ms, until_ms, params)
    if tenant_id is not None:
        where += " AND tenant_id = {tenant:String}"
        params["tenant"] = tenant_id
    return _clean(store.dicts(
        "SELECT request_id, tenant_id, model, adapter, status, billable, prompt_tokens, cached_tokens, "
        "completion_tokens, cost_pusd FROM {db}.ledger FINAL WHERE " + where + " ORDER BY request_id LIMIT {limit:UInt32}", params))


def lookup_requests(store: Store, request_ids: list[str]) -> list[dict]:
    """Ledger rows (deduplicated) for these request ids (the ones found)."""
    if not request_ids:
        return []
    out: list[dict] = []
    for i in range(0, len(request_ids), 10_000):
        out += _clean(store.dicts(
            "SELECT request_id, tenant_id, model, adapter, status, billable, prompt_tokens, cached_tokens, "
            "completion_tokens, cost_pusd FROM {db}.ledger FINAL WHERE request_id IN {ids:Array(String)}",
            {"ids": request_ids[i:i + 10_000]}))
    return out


def ledger_totals(store: Store) -> dict:
    """Whole-ledger check numbers: rows, distinct requests, tokens (deduplicated)."""
    r = store.dicts(
        "SELECT count() AS rows, uniqExact(request_id) AS requests, sumIf(total_tokens, billable = 1) AS tokens, "
        "sumIf(completion_tokens, billable = 1) AS completion_tokens, toInt64(sum(cost_pusd)) AS cost_pusd "
        "FROM {db}.ledger FINAL")[0]
    return {k: int(v) for k, v in r.items()}




# --- over time, across tenants (the dashboard) ---------------------------------------------------
# Bucket widths a chart of a window is drawn in: the smallest that keeps it under ~120 points.
# A minute is the floor, the aggregate's own grain.
BUCKET_WIDTHS_S = (60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 7 * 86400)


def bucket_width_s(since_ms: int, until_ms: int, max_points: int = 120) -> int:
    span_s = max(0, until_ms - since_ms) / 1000
    return next((w for w in BUCKET_WIDTHS_S if span_s / w <= max_points), BUCKET_WIDTHS_S[-1])


def _tenant_filter(tenants: list[str] | None, params: dict) -> str:
    if not tenants:
        return ""
    params["tenants"] = list(tenants)
    return " AND tenant_id IN {tenants:Array(String)}"


def usage_over_time(store: Store, bucket_s: int, since_ms: int, until_ms: int,
                    tenants: list[str] | None = None) -> list[dict]:
    """[{t_ms, tenant_id, model, requests, finished, ..., tokens, cost_usd}] per bucket of ``bucket_s``."""
    params: dict = {"width": int(bucket_s)}
    where = _window("minute", since_ms, until_ms, params, minute=True) + _tenant_filter(tenants, params)
    return _named(store.dicts(
        f"SELECT toStartOfInterval(minute, toIntervalSecond({{width:UInt32}})) AS t_ms, tenant_id, {MODEL_ID}, "
        f"sum(finished) AS finished, {SUMS} FROM {{db}}.usage_minute FINAL WHERE {where} "
        "GROUP BY t_ms, tenant_id, model_id ORDER BY t_ms, tenant_id, model_id", params))


def latency_over_time(store: Store, bucket_s: int, since_ms: int, until_ms: int,
                      tenants: list[str] | None = None) -> list[dict]:
    """TTFT and TPOT p50/p95/p99 (exact) of the requests that finished in each bucket."""
    params: dict = {"width": int(bucket_s)}
    where = ("status = 'finished' AND " + _window("finished_at", since_ms, until_ms, params)
             + _tenant_filter(tenants, params))
    rows = store.dicts(
        "SELECT toStartOfInterval(finished_at, toIntervalSecond({width:UInt32})) AS t_ms, count() AS requests, "
        "quantilesExactIf(0.5, 0.95, 0.99)(ttft_ms, ttft_ms IS NOT NULL) AS ttft, "
        "quantilesExactIf(0.5, 0.95, 0.99)(tpot_ms, tpot_ms IS NOT NULL) AS tpot "
        f"FROM {{db}}.ledger FINAL WHERE {where} GROUP BY t_ms ORDER BY t_ms", params)
    out = []
    for r in _clean(rows):
        item = {"t_ms": r["t_ms"], "requests": r["requests"]}
        for name in ("ttft", "tpot"):
            for label, v in zip(("p50", "p95", "p99"), r[name] or []):
                item[f"{name}_{label}_ms"] = None if v != v else float(v)  # NaN when no values
        out.append(item)
    return out


def tenants_in_window(store: Store, since_ms: int | None, until_ms: int | None) -> list[str]:
    params: dict = {}
    where = _window("minute", since_ms, until_ms, params, minute=True)
    return [r[0] for r in store.rows(
        f"SELECT DISTINCT tenant_id FROM {{db}}.usage_minute FINAL WHERE {where} ORDER BY tenant_id", params)]


def summary(store: Store, since_ms: int | None = None, until_ms: int | None = None, limit: int = 10) -> dict:
    """What `tokenmill usage summary` shows: totals by model, top tenants, latency; and, for a window
    with a start, the same over time (``over_time``: per-bucket usage rows and latency percentiles)."""
    out: dict[str, Any] = {"since_ms": since_ms, "until_ms": until_ms,
                           "by_model": by_model(store, since_ms, until_ms),
                           "top_tenants": top_tenants(store, since_ms, until_ms, limit=limit),
                           "latency": latency_by_model(store, since_ms, until_ms)}
    if since_ms is not None:
        end = until_ms if until_ms is not None else int(time.time() * 1000)
        width = bucket_width_s(since_ms, end)
        out["over_time"] = {"since_ms": since_ms, "until_ms": end, "bucket_s": width,
                            "usage": usage_over_time(store, width, since_ms, end),
                            "latency": latency_over_time(store, width, since_ms, end)}
    return out
