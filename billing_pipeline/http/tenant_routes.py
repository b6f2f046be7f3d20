"""`/v1/usage...`: a tenant's own usage, asked through ingress (which forwards the tenant)."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from billing_pipeline import budget
from billing_pipeline.http.access import tenant_of
from billing_pipeline.http.context import Context
from billing_pipeline.http.reports import tenant_report

router = APIRouter()


@router.get("/v1/usage")
def my_usage(context: Context, tenant: str = Depends(tenant_of), since: str | None = "30d",
             until: str | None = None, bucket: str = "day", model: str | None = None) -> dict:
    return tenant_report(context.store, tenant, since, until, bucket, model)


@router.get("/v1/usage/month-to-date")
def my_month_to_date(context: Context, tenant: str = Depends(tenant_of)) -> dict:
    return {"tenant_id": tenant, **budget.month_to_date_detail(tenant, store=context.store)[tenant]}
