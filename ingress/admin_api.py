"""The admin HTTP API (tenants and keys), behind the admin token.

It publishes the same tenant snapshots as `tokenmill tenants|keys`, so every ingress
and streams process picks the change up from the `tenants` topic.
"""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from ingress.errors import APIError
from ingress.tenant_admin import TENANT_FIELDS, TenantAdmin
from infra.config import admin_token, same_secret


def _public(tenant: dict[str, Any]) -> dict[str, Any]:
    out = {k: tenant[k] for k in ("tenant_id", *TENANT_FIELDS)}
    out["api_keys"] = [{"key_id": k["key_id"], "prefix": k["prefix"], "created_ms": k["created_ms"],
                        "revoked_ms": k["revoked_ms"]} for k in tenant["api_keys"]]
    return out


def admin_router(ingress) -> APIRouter:
    router = APIRouter(prefix="/admin")
    token = admin_token()
    admin: TenantAdmin | None = None

    def authorize(request: Request) -> TenantAdmin:
        nonlocal admin
        presented = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not same_secret(presented, token):
            raise APIError(401, "Admin token required.", code="invalid_admin_token")
        if admin is None:
            admin = TenantAdmin(ingress.settings.secret)
        return admin

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except Exception:
            raise APIError(400, "The body must be a JSON object.", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "The body must be a JSON object.", code="invalid_json")
        return data

    @router.get("/tenants")
    async def list_tenants(request: Request):
        ops = authorize(request)
        return {"data": [_public(t) for t in await asyncio.to_thread(ops.list)]}

    @router.put("/tenants/{tenant_id}")
    async def upsert_tenant(tenant_id: str, request: Request):
        ops = authorize(request)
        data = await json_body(request)
        try:
            record = await asyncio.to_thread(ops.upsert, tenant_id, **data)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        return _public(record)

    @router.post("/tenants/{tenant_id}/keys")
    async def issue_key(tenant_id: str, request: Request):
        ops = authorize(request)
        try:
            issued = await asyncio.to_thread(ops.issue_key, tenant_id)
        except KeyError:
            raise APIError(404, f"No tenant '{tenant_id}'.", code="tenant_not_found") from None
        return {"key": issued.key, "prefix": issued.prefix, "tenant_id": tenant_id}

    @router.delete("/keys/{prefix}")
    async def revoke_key(prefix: str, request: Request):
        ops = authorize(request)
        try:
            tenant_id = await asyncio.to_thread(ops.revoke_key, prefix)
        except KeyError:
            raise APIError(404, f"No active key '{prefix}'.", code="key_not_found") from None
        return {"revoked": prefix, "tenant_id": tenant_id}

    @router.get("/quota/{tenant_id}")
    async def quota(tenant_id: str, request: Request):
        authorize(request)
        tokens, requests = ingress.admission.in_flight(tenant_id)
        return {"tenant_id": tenant_id, "in_flight_tokens": tokens, "in_flight_requests": requests}

    return router
