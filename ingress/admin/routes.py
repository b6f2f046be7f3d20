"""The admin HTTP API (tenants and keys), behind the admin token.

It publishes the same tenant snapshots as `tokenmill tenants|keys`, so every ingress
and streams process picks the change up from the `tenants` topic.
"""
from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from http_api.openai_errors import APIError
from http_api.bearer import bearer_token
from ingress.context import Context
from ingress.http import json_body
from ingress.protocol import openapi_body
from ingress.tenancy.tenant_admin import TENANT_FIELDS, InvalidTenantId, TenantAdmin, require_valid_tenant_id
from infra.config import admin_token, same_secret
from schemas.checks import TENANT_ID_PATTERN, TENANT_ID_RULE

# The documented pattern, in the OpenAPI description too, so a client (or schemathesis) reads what an
# id may be instead of learning it from a 400. Only described here: valid_tenant_id checks it and says
# in its 400 what a tenant id is.
TenantId = Annotated[str, Path(description=f"{TENANT_ID_RULE}.",
                               json_schema_extra={"pattern": f"^{TENANT_ID_PATTERN.pattern}$"})]


Count = Annotated[StrictInt, Field(ge=0, lt=2**31)]  # the schema's Avro int
Total = Annotated[StrictInt, Field(ge=0, le=2**53)]  # its Avro long, within what every JSON parser reads exactly


class TenantSettings(BaseModel):
    """`PUT /admin/tenants/{tenant_id}`: the settings to change. Absent or null leaves a setting as it is; a new
    tenant starts from the TenantSnapshot schema's defaults."""
    model_config = ConfigDict(strict=True, extra="forbid")

    name: StrictStr | None = None
    plan: StrictStr | None = None
    requests_per_minute: Count | None = None
    tokens_per_minute: Total | None = None
    max_concurrent: Count | None = None
    monthly_token_budget: Total | None = None
    allowed_models: list[StrictStr] | None = Field(default=None, description="Empty: every served model.")
    allowed_priorities: list[Literal["interactive", "batch"]] | None = None
    fairness_weight: Annotated[float, Field(gt=0, le=10**6)] | None = None
    default_deadline_s: Annotated[float, Field(gt=0, le=86400)] | None = None
    max_queued: Count | None = None
    share_prefix_cache: StrictBool | None = None
    disabled: StrictBool | None = None


def _public(tenant: dict[str, Any]) -> dict[str, Any]:
    out = {k: tenant[k] for k in ("tenant_id", *TENANT_FIELDS)}
    out["api_keys"] = [{"key_id": k["key_id"], "prefix": k["prefix"], "created_ms": k["created_ms"],
                        "revoked_ms": k["revoked_ms"]} for k in tenant["api_keys"]]
    return out


class AdminAccess:
    """The admin token, and the tenant writer it unlocks (made on first use: it opens a producer)."""

    def __init__(self, secret: bytes, token: str | None = None):
        self.secret, self.token = secret, token if token is not None else admin_token()
        self._admin: TenantAdmin | None = None

    def authorize(self, request: Request) -> TenantAdmin:
        if not same_secret(bearer_token(request.headers.get("authorization")), self.token):
            raise APIError(401, "Admin token required.", code="invalid_admin_token")
        if self._admin is None:
            self._admin = TenantAdmin(self.secret)
        return self._admin


def valid_tenant_id(tenant_id: str) -> str:
    """The path's tenant id, or a 400 naming it (schemas.checks.TENANT_ID_PATTERN)."""
    try:
        require_valid_tenant_id(tenant_id)
    except InvalidTenantId as exc:
        raise APIError(400, f"Invalid 'tenant_id': {exc}.", code="invalid_value", param="tenant_id") from None
    return tenant_id


def admin_access(request: Request) -> AdminAccess:
    return request.app.state.admin


Admin = Annotated[AdminAccess, Depends(admin_access)]
router = APIRouter(prefix="/admin")


@router.get("/tenants")
async def list_tenants(request: Request, access: Admin):
    ops = access.authorize(request)
    return {"data": [_public(t) for t in await asyncio.to_thread(ops.tenants)]}


@router.put("/tenants/{tenant_id}", openapi_extra=openapi_body(TenantSettings))
async def upsert_tenant(tenant_id: TenantId, request: Request, access: Admin):
    ops = access.authorize(request)
    valid_tenant_id(tenant_id)
    data = (await json_body.parse(request, TenantSettings)).model_dump(exclude_none=True)
    try:
        record = await asyncio.to_thread(ops.upsert, tenant_id, **data)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), code="invalid_value") from None
    return _public(record)


@router.post("/tenants/{tenant_id}/keys")
async def issue_key(tenant_id: TenantId, request: Request, access: Admin):
    ops = access.authorize(request)
    valid_tenant_id(tenant_id)
    try:
        issued = await asyncio.to_thread(ops.issue_key, tenant_id)
    except KeyError:
        raise APIError(404, f"No tenant '{tenant_id}'.", code="tenant_not_found") from None
    return {"key": issued.key, "prefix": issued.prefix, "tenant_id": tenant_id}


@router.delete("/keys/{prefix}")
async def revoke_key(prefix: str, request: Request, access: Admin):
    ops = access.authorize(request)
    try:
        tenant_id = await asyncio.to_thread(ops.revoke_key, prefix)
    except KeyError:
        raise APIError(404, f"No active key '{prefix}'.", code="key_not_found") from None
    return {"revoked": prefix, "tenant_id": tenant_id}


@router.get("/quota/{tenant_id}")
async def quota(tenant_id: TenantId, request: Request, access: Admin, context: Context):
    access.authorize(request)
    valid_tenant_id(tenant_id)
    tokens, requests = context.admission.in_flight(tenant_id)
    return {"tenant_id": tenant_id, "in_flight_tokens": tokens, "in_flight_requests": requests}
