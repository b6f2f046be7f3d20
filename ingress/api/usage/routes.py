"""`GET /v1/usage`: a tenant's own usage, answered by the billing process.

The embedded ClickHouse can be opened by one process only, so ingress asks billing on
the caller's behalf, naming the tenant it authenticated. The tenant id never comes
from the client, so no tenant can ask for another's usage.
"""
from __future__ import annotations

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from infra.openai_errors import APIError
from infra.config import billing_url, internal_token


def usage_router(ingress) -> APIRouter:
    router = APIRouter()
    client = httpx.AsyncClient(base_url=billing_url(), timeout=30)
    token = internal_token()

    async def forward(request: Request, path: str):
        caller = ingress.authenticate(request)
        params = [(k, v) for k, v in request.query_params.multi_items() if k not in ("tenant", "tenant_id")]
        try:
            resp = await client.get(path, params=params, headers={
                "x-tokenmill-tenant": caller.tenant_id, "x-tokenmill-internal-token": token})
        except httpx.HTTPError as exc:
            raise APIError(503, f"Usage analytics are unavailable: {type(exc).__name__}.",
                           code="billing_unavailable", headers={"Retry-After": "5"}) from None
        return JSONResponse(resp.json(), status_code=resp.status_code)

    @router.get("/v1/usage")
    async def usage(request: Request):
        return await forward(request, "/v1/usage")

    @router.get("/v1/usage/month-to-date")
    async def month_to_date(request: Request):
        return await forward(request, "/v1/usage/month-to-date")

    return router
