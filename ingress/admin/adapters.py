"""The admin API's LoRA adapter routes (docs/lora.md, "Registry, API and billing"), behind the admin token.

    POST   /admin/tenants/{tenant_id}/adapters          {"name", "base_model", "adapter_config", "weights"}
    GET    /admin/tenants/{tenant_id}/adapters
    GET    /admin/adapters
    DELETE /admin/tenants/{tenant_id}/adapters/{name}
    POST   /admin/adapters/sweep                         {"grace_s"?}: tombstones chunks no manifest names

`weights` is the base64 text of adapter_model.safetensors, `adapter_config` the JSON object of its
adapter_config.json. Every check runs before anything is written (ingress/tenancy/adapter_registry.py);
a refusal is a 400 in OpenAI's error format naming the field in `param`. The body is read here and checked
in a process of its own (adapter_uploads.py), so an upload never stalls the public API's event loop.
"""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from lora import adapters
from infra.config import max_adapter_bytes
from http_api.openai_errors import APIError
from ingress.admin.routes import Admin, TenantId, valid_tenant_id
from ingress.context import Context
from ingress.http import json_body
from ingress.admin.adapter_uploads import UploadPool
from ingress.tenancy.adapter_registry import AdapterRegistry, AdapterRejected

router = APIRouter(prefix="/admin")
SETTLE_S = 5.0


def registration_body_limit() -> int:
    """The largest registration body: the weights in base64 (4/3) and room for the config."""
    return max_adapter_bytes() * 4 // 3 + 2**20


def _registry(context) -> AdapterRegistry:
    registry = getattr(context, "adapter_registry", None)
    if registry is None:
        registry = context.adapter_registry = AdapterRegistry(context.settings.models)
    return registry


def _uploads(context) -> UploadPool:
    uploads = getattr(context, "adapter_uploads", None)
    if uploads is None:
        uploads = context.adapter_uploads = UploadPool()
    return uploads


async def _settled(context) -> adapters.AdapterCatalog:
    # Read what the topic holds now first, so a name registered a moment ago elsewhere is a clash here.
    await context.adapters.settled(SETTLE_S)
    return context.adapters.catalog


def _require_tenant(context, tenant_id: str) -> None:
    if tenant_id not in context.tenants.directory.tenants:
        raise APIError(404, f"No tenant '{tenant_id}'.", code="tenant_not_found", param="tenant_id")


@router.post("/tenants/{tenant_id}/adapters")
async def register_adapter(tenant_id: TenantId, request: Request, access: Admin, context: Context):
    access.authorize(request)
    valid_tenant_id(tenant_id)
    _require_tenant(context, tenant_id)
    uploads, registry = _uploads(context), _registry(context)
    uploads.admit()  # a 429 before the body is read when the most uploads at once are in progress
    try:
        raw = await json_body.read_body(request, registration_body_limit())
        reg, checked = await uploads.prepare(raw, tenant_id, registry)
        del raw
        catalog = await _settled(context)
        manifest = await uploads.run(registry.register, reg, catalog, checked)
    except AdapterRejected as exc:
        status = 429 if exc.code == "adapter_quota_exceeded" else 400
        raise APIError(status, str(exc), code=exc.code, param=exc.param) from None
    finally:
        uploads.release()
    with context.adapters.lock:  # this process resolves it from now on, without waiting for its follower
        context.adapters.catalog.apply_manifest(manifest["adapter_id"], manifest)
    return adapters.public(manifest)


@router.get("/tenants/{tenant_id}/adapters")
async def list_tenant_adapters(tenant_id: TenantId, request: Request, access: Admin, context: Context):
    access.authorize(request)
    valid_tenant_id(tenant_id)
    catalog = await _settled(context)
    return {"object": "list", "data": [adapters.public(m) for m in catalog.of_tenant(tenant_id)]}


@router.get("/adapters")
async def list_adapters(request: Request, access: Admin, context: Context):
    access.authorize(request)
    catalog = await _settled(context)
    found = sorted(catalog.manifests.values(), key=lambda m: (m["tenant_id"], m["name"]))
    return {"object": "list", "data": [adapters.public(m) for m in found]}


@router.post("/adapters/sweep")
async def sweep_adapters(request: Request, access: Admin, context: Context):
    access.authorize(request)
    data: dict[str, Any] = await json_body.read_object(request, 4096) if await request.body() else {}
    grace = data.get("grace_s", adapters.SWEEP_GRACE_S)
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace <= 86400 * 30:
        raise APIError(400, "'grace_s' must be a number of seconds from 0 to 2592000.", code="invalid_value",
                       param="grace_s")
    catalog = await _settled(context)
    with context.adapters.lock:
        snapshot = adapters.AdapterCatalog(manifests=dict(catalog.manifests), chunk_keys=dict(catalog.chunk_keys))
    swept = await asyncio.to_thread(adapters.sweep, _registry(context).publisher, snapshot, float(grace))
    return {"object": "adapter.sweep", "tombstoned_chunks": len(swept)}


@router.delete("/tenants/{tenant_id}/adapters/{name}")
async def delete_adapter(tenant_id: TenantId, name: str, request: Request, access: Admin, context: Context):
    access.authorize(request)
    valid_tenant_id(tenant_id)
    catalog = await _settled(context)
    try:
        manifest = await asyncio.to_thread(_registry(context).delete, tenant_id, name, catalog)
    except KeyError:
        raise APIError(404, f"Tenant '{tenant_id}' has no adapter named '{name}'.", code="adapter_not_found",
                       param="name") from None
    with context.adapters.lock:  # new requests here stop at once; running ones finish on their workers
        context.adapters.catalog.apply_manifest(manifest["adapter_id"], None)
    return {"id": adapters.model_id(manifest["base_model"], manifest["name"]), "object": "adapter",
            "deleted": True}
