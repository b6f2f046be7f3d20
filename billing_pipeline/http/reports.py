"""The query parameters that tenant and admin routes share: a time window, and one tenant's report."""
from __future__ import annotations

from typing import Any

from fastapi import HTTPException

from billing_pipeline import analytics
from billing_pipeline.store import Store


def window(since: str | None, until: str | None) -> tuple[int | None, int | None]:
    try:
        return analytics.parse_time(since), analytics.parse_time(until)
    except ValueError as exc:
        raise HTTPException(400, f"bad time: {exc}") from None


def tenant_report(store: Store, tenant: str, since: str | None, until: str | None, bucket: str,
                  model: str | None) -> dict[str, Any]:
    """One tenant's totals over the window and its series in `bucket`s (of one model, if named)."""
    s, u = window(since, until)
    if bucket not in analytics.BUCKETS:
        raise HTTPException(400, f"bucket must be one of {sorted(analytics.BUCKETS)}")
    out = analytics.tenant_totals(store, tenant, s, u)
    out["bucket"] = bucket
    out["series"] = analytics.tenant_timeseries(store, tenant, bucket, s, u, model)
    return out
