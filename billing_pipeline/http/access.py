"""Who may ask: a tenant, through ingress (the internal service token and the tenant it vouches for),
or an operator (the admin token)."""
from __future__ import annotations

from fastapi import HTTPException, Request

from billing_pipeline.http.context import Context
from http_api.bearer import bearer_token
from infra.config import same_secret

TENANT_HEADER = "x-tokenmill-tenant"
INTERNAL_TOKEN_HEADER = "x-tokenmill-internal-token"
ADMIN_TOKEN_HEADER = "x-tokenmill-admin-token"


def tenant_of(request: Request, context: Context) -> str:
    """The tenant ingress forwarded; a request naming any other tenant is refused."""
    if not same_secret(request.headers.get(INTERNAL_TOKEN_HEADER), context.internal_token):
        raise HTTPException(401, "missing or invalid internal service token")
    tenant = request.headers.get(TENANT_HEADER)
    if not tenant:
        raise HTTPException(401, f"missing {TENANT_HEADER}")
    asked = request.query_params.get("tenant_id") or request.query_params.get("tenant")
    if asked is not None and asked != tenant:
        raise HTTPException(403, "a tenant can only read its own usage")
    return tenant


def require_admin(request: Request, context: Context) -> None:
    token = bearer_token(request.headers.get("authorization"))
    if token is None:
        token = request.headers.get(ADMIN_TOKEN_HEADER)
    if not same_secret(token, context.admin_token):  # missing or wrong: one answer, as ingress gives
        raise HTTPException(401, "admin token required")
