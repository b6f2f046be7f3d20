"""`/admin/...`: every tenant's usage, the ledger and the price book, for operators (the admin token)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel

from billing_pipeline import analytics, budget, ledger, pricing
from billing_pipeline.http.access import require_admin
from billing_pipeline.http.context import Context
from billing_pipeline.http.reports import tenant_report, window

router = APIRouter(dependencies=[Depends(require_admin)])


class PriceIn(BaseModel):
    model: str
    token_kind: str
    usd_per_mtok: float | str
    effective_from: int | str | None = None
    tenant_id: str = ""  # that tenant's price only; an adapter's model id needs it


class LookupIn(BaseModel):
    request_ids: list[str]


@router.get("/admin/usage/tenants/{tenant_id}")
def tenant_usage(context: Context, tenant_id: str, since: str | None = "30d", until: str | None = None,
                 bucket: str = "day", model: str | None = None) -> dict:
    return tenant_report(context.store, tenant_id, since, until, bucket, model)


@router.get("/admin/usage/top-tenants")
def top(context: Context, since: str | None = "30d", until: str | None = None,
        limit: int = Query(10, ge=1, le=1000), by: str = "tokens") -> list[dict]:
    if by not in ("tokens", "cost", "requests"):
        raise HTTPException(400, "by must be tokens, cost or requests")
    return analytics.top_tenants(context.store, *window(since, until), limit=limit, by=by)


@router.get("/admin/usage/models")
def models(context: Context, since: str | None = "30d", until: str | None = None) -> list[dict]:
    return analytics.by_model(context.store, *window(since, until))


@router.get("/admin/usage/latency")
def latency(context: Context, since: str | None = "1d", until: str | None = None) -> list[dict]:
    return analytics.latency_by_model(context.store, *window(since, until))


@router.get("/admin/usage/summary")
def summary(context: Context, since: str | None = "1d", until: str | None = None, limit: int = 10) -> dict:
    return analytics.summary(context.store, *window(since, until), limit=limit)


@router.get("/admin/usage/month-to-date")
def month_to_date(context: Context, tenant_id: str | None = None) -> dict:
    return budget.month_to_date_detail(tenant_id, store=context.store)


@router.get("/admin/ledger/requests")
def ledger_requests(context: Context, since: str | None = "1d", until: str | None = None,
                    tenant_id: str | None = None, limit: int = Query(100_000, ge=1, le=1_000_000)) -> list[dict]:
    return analytics.requests_in_window(context.store, *window(since, until), tenant_id=tenant_id, limit=limit)


@router.post("/admin/ledger/lookup")
def ledger_lookup(context: Context, body: LookupIn) -> list[dict]:
    return analytics.lookup_requests(context.store, body.request_ids)


@router.get("/admin/ledger/totals")
def ledger_totals(context: Context) -> dict:
    return analytics.ledger_totals(context.store)


@router.post("/admin/ledger/rebuild-aggregate")
def rebuild(context: Context) -> dict:
    return {"buckets": ledger.rebuild_aggregate(context.store)}


@router.get("/admin/prices")
def prices(context: Context) -> list[dict]:
    return pricing.list_prices(context.store)


@router.put("/admin/prices")
def put_price(context: Context, body: PriceIn) -> dict:
    try:
        out = pricing.set_price(context.store, body.model, body.token_kind, body.usd_per_mtok, body.effective_from,
                                body.tenant_id)
    except (ValueError, TypeError) as exc:
        raise HTTPException(400, str(exc)) from None
    if context.writer is not None:
        context.writer.reload_prices()  # the writer prices the rows it inserts from now on
    return out
