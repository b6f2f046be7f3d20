"""`GET /v1/usage`: a tenant's own usage, answered by the billing process.

The embedded ClickHouse can be opened by one process only, so ingress asks billing on
the caller's behalf, naming the tenant it authenticated. The tenant id never comes
from the client, so no tenant can ask for another's usage.
"""
from __future__ import annotations

from typing import Annotated

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from infra.config import billing_url, internal_token
from http_api.openai_errors import APIError
from ingress.context import Context
from ingress.tenancy.directory import Caller


class UsageProxy:
    """Billing's usage routes, asked with the internal token on an authenticated tenant's behalf."""

    def __init__(self) -> None:
        self.client = httpx.AsyncClient(base_url=billing_url(), timeout=30)
        self.token = internal_token()

    async def forward(self, caller: Caller, request: Request, path: str) -> JSONResponse:
        params = httpx.QueryParams([(k, v) for k, v in request.query_params.multi_items()
                                    if k not in ("tenant", "tenant_id")])
        try:
            resp = await self.client.get(path, params=params, headers={
                "x-tokenmill-tenant": caller.tenant_id, "x-tokenmill-internal-token": self.token})
        except httpx.HTTPError as exc:
            raise APIError(503, f"Usage analytics are unavailable: {type(exc).__name__}.",
                           code="billing_unavailable", headers={"Retry-After": "5"}) from None
        return JSONResponse(resp.json(), status_code=resp.status_code)


def usage_proxy(request: Request) -> UsageProxy:
    return request.app.state.usage


Proxy = Annotated[UsageProxy, Depends(usage_proxy)]
router = APIRouter()


@router.get("/v1/usage")
async def usage(request: Request, context: Context, proxy: Proxy):
    return await proxy.forward(context.authenticator.caller(request.headers), request, "/v1/usage")


@router.get("/v1/usage/month-to-date")
async def month_to_date(request: Request, context: Context, proxy: Proxy):
    return await proxy.forward(context.authenticator.caller(request.headers), request, "/v1/usage/month-to-date")
