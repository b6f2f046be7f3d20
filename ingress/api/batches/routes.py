"""`/v1/files` and `/v1/batches`, so the official OpenAI SDK can run batches against tokenmill.

The composition root mounts `router` and puts a `BatchService` (over the process's served models) in
the app's state. Files and batches belong to the calling tenant; another tenant's ids answer 404.
Submitting and refreshing run in a worker thread (tokenizing and reading Kafka are blocking).
"""
from __future__ import annotations

import asyncio
import functools
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel

from ingress.api.batches.parse import ENDPOINTS
from ingress.api.batches.service import BatchRefused, BatchService
from ingress.api.batches.store import BatchStore
from http_api.openai_errors import APIError
from ingress.http.metadata_limits import checked_metadata
from ingress.context import Context, IngressContext
from ingress.http import json_body
from ingress.tenancy.directory import Caller
from infra import settings




def max_file_bytes() -> int:
    """The largest batch input file `/v1/files` accepts."""
    return settings.BATCH_MAX_FILE_BYTES.get()

def _errors_as_responses(fn):
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except APIError as exc:
            return exc.response()
    return wrapper


def _public_file(meta: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI `File` object; a field without a value (`status_details`) is left out, not sent as null."""
    return {k: v for k, v in meta.items() if k != "tenant_id" and v is not None}


def batch_object(manifest: dict[str, Any], status: str, counts: dict[str, int]) -> dict[str, Any]:
    """The OpenAI `Batch` object for a manifest."""
    final = manifest.get("final") or {}
    created = manifest["created_at_ms"] // 1000
    cancel_at = manifest.get("cancel_requested_at_ms")
    end_at = final.get("at_ms", 0) // 1000 if final else None
    errors = None
    if status == "failed":
        errors = {"object": "list", "data": [{"code": "no_valid_requests", "message":
                                              "No line of the input file is a valid request; see the error file.",
                                              "param": None, "line": None}]}
    batch = {
        "id": manifest["batch_id"], "object": "batch", "endpoint": manifest.get("endpoint") or "/v1/chat/completions",
        "errors": errors, "input_file_id": manifest.get("input_file_id") or "", "completion_window":
            manifest["completion_window"], "status": status,
        "output_file_id": final.get("output_file_id"), "error_file_id": final.get("error_file_id"),
        "created_at": created, "in_progress_at": (manifest.get("published_at_ms") or 0) // 1000 or None,
        "expires_at": manifest["deadline_ms"] // 1000,
        "finalizing_at": end_at if status == "completed" else None,
        "completed_at": end_at if status == "completed" else None,
        "failed_at": end_at if status == "failed" else None,
        "expired_at": end_at if status == "expired" else None,
        "cancelling_at": cancel_at // 1000 if cancel_at else None,
        "cancelled_at": end_at if status == "cancelled" else None,
        "request_counts": {"total": counts["total"], "completed": counts["completed"],
                           # cancelled and expired requests have no result: OpenAI counts them as failed
                           "failed": counts["failed"] + counts["cancelled"] + counts["expired"]},
        "metadata": manifest.get("metadata") or None,
    }
    # OpenAI's schema types the timestamps, file ids and `errors` without null: left out until they have a value
    return {k: v for k, v in batch.items() if v is not None}


# The bodies these routes parse themselves, as the OpenAPI document states them (clients and fuzzers read it).
FILE_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string", "enum": ["batch"]},
                   "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                   "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000}}}}}}}
BATCH_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
    "properties": {"input_file_id": {"type": "string"}, "endpoint": {"type": "string", "enum": sorted(ENDPOINTS)},
                   "completion_window": {"type": "string"},
                   "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}}}}}}


def batch_service(request: Request) -> BatchService:
    return request.app.state.batches


def serving_batches(context: IngressContext, store: BatchStore | None = None) -> BatchService:
    """The batch operations over this process's served models and its view of the tenants' adapters."""
    follower = context.adapters

    def adapter(tenant_id: str, model: str):
        with follower.lock:
            return follower.catalog.resolve(tenant_id, model)

    return BatchService(store or BatchStore(), context.models.get, context.settings.default_max_tokens,
                        adapters=adapter)


Batches = Annotated[BatchService, Depends(batch_service)]
router = APIRouter()


def counted(context: IngressContext, request: Request) -> Caller:
    """Authenticate, and count the call against the tenant's request rate (EdgeAdmission.meter: one
    request, no tokens, no concurrency slot): the batch and file routes do disk and Kafka work, so they
    are rationed too."""
    caller = context.authenticator.caller(request.headers)
    context.admission.meter(caller)
    return caller


def own_file(service: BatchService, caller: Caller, file_id: str) -> dict[str, Any]:
    meta = service.store.file_meta(file_id)
    if meta is None or meta["tenant_id"] != caller.tenant_id:
        raise APIError(404, f"No such File object: {file_id}", code="file_not_found", param="id")
    return meta


def own_batch(service: BatchService, caller: Caller, batch_id: str) -> dict[str, Any]:
    manifest = service.store.load(batch_id)
    if manifest is None or manifest["tenant_id"] != caller.tenant_id:
        raise APIError(404, f"No batch found with id '{batch_id}'.", code="batch_not_found", param="batch_id")
    return manifest


async def current(context: IngressContext, service: BatchService, batch_id: str) -> dict[str, Any]:
    """The batch as its results so far make it: read from `batch-results` on the process's Kafka read pool
    (ingress/kafka/reads.py), never the default pool every tenant's prompts are tokenized on."""
    manifest, fold = await context.kafka_reads.run(service.finalize_if_done, batch_id)
    status, counts = service.status(manifest, fold)
    return batch_object(manifest, status, counts)


# What the answers hold, for the OpenAPI document (OpenAI's `OpenAIFile`, `Batch` and their lists; the keys always
# present are required, the others appear once they have a value and are never null). Documentation only: the
# routes build their bodies themselves (`_public_file`, `batch_object`).
class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"]
    expires_at: int | None = None  # left out when the file never expires (batch output files)


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    created_at: int
    expires_at: int
    request_counts: BatchCounts


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    has_more: bool


def _documented(model: type[BaseModel], description: str) -> dict:
    return {200: {"model": model, "description": description}}


@router.post("/v1/files", openapi_extra=FILE_UPLOAD_BODY, responses=_documented(FileObject, "The file"))
@_errors_as_responses
async def create_file(request: Request, context: Context, service: Batches):
    caller = counted(context, request)
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_file_bytes() + 65536:
        raise APIError(413, f"Files may be at most {max_file_bytes()} bytes.", code="file_too_large")
    form = await request.form()
    upload, purpose = form.get("file"), form.get("purpose")
    if upload is None or isinstance(upload, str):
        raise APIError(400, "Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
    if purpose != "batch":
        raise APIError(400, f"Only purpose 'batch' is supported (got {purpose!r}).", param="purpose",
                       code="invalid_value")
    expires_at = int(time.time()) + _expires_after(form)
    content = await upload.read()
    if len(content) > max_file_bytes():
        raise APIError(413, f"Files may be at most {max_file_bytes()} bytes.", code="file_too_large")
    # One upload of a tenant at a time checks and adds to its bytes, so two at once cannot both pass.
    async with _uploading.setdefault(caller.tenant_id, asyncio.Lock()):
        used = await asyncio.to_thread(service.store.file_bytes, caller.tenant_id)
        quota = files_bytes_per_tenant()
        if used + len(content) > quota:
            raise APIError(429, f"This API key's organisation stores {used} bytes of files; {len(content)} more "
                                f"would pass its quota of {quota}. Delete files or wait for them to expire.",
                           code="files_quota_exceeded")
        meta = await asyncio.to_thread(service.store.put_file, caller.tenant_id, upload.filename or "upload.jsonl",
                                       "batch", content, None, expires_at)
    return _public_file(meta)


def files_bytes_per_tenant() -> int:
    return settings.FILES_BYTES_PER_TENANT.get()


_uploading: dict[str, asyncio.Lock] = {}
# OpenAI's files API: `expires_after` anchored at `created_at`, 1 hour to 30 days; a batch file expires after
# 30 days when it names none.
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 86400


def _expires_after(form) -> int:
    """The seconds after creation the upload expires, from the form's `expires_after[anchor]` and
    `expires_after[seconds]` (as the SDKs send it), or 30 days."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return MAX_EXPIRY_S
    if anchor != "created_at":
        raise APIError(400, "expires_after.anchor must be 'created_at'.", param="expires_after.anchor",
                       code="invalid_value")
    if not isinstance(seconds, str) or not seconds.isdigit() or not MIN_EXPIRY_S <= int(seconds) <= MAX_EXPIRY_S:
        raise APIError(400, f"expires_after.seconds must be an integer from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}.",
                       param="expires_after.seconds", code="invalid_value")
    return int(seconds)


@router.get("/v1/files", responses=_documented(FileList, "The tenant's files"))
@_errors_as_responses
async def list_files(request: Request, context: Context, service: Batches):
    caller = counted(context, request)
    data = [_public_file(m) for m in await asyncio.to_thread(service.store.list_files, caller.tenant_id)]
    return {"object": "list", "data": data, "has_more": False,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@router.get("/v1/files/{file_id}", responses=_documented(FileObject, "The file"))
@_errors_as_responses
async def retrieve_file(file_id: str, request: Request, context: Context, service: Batches):
    return _public_file(own_file(service, counted(context, request), file_id))


@router.get("/v1/files/{file_id}/content", response_class=Response, responses={200: {
    "description": "The file's bytes, as uploaded",
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
@_errors_as_responses
async def file_content(file_id: str, request: Request, context: Context, service: Batches):
    own_file(service, counted(context, request), file_id)
    return Response(await asyncio.to_thread(service.store.file_content, file_id),
                    media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", responses=_documented(FileDeleted, "The file is deleted"))
@_errors_as_responses
async def delete_file(file_id: str, request: Request, context: Context, service: Batches):
    own_file(service, counted(context, request), file_id)
    await asyncio.to_thread(service.store.delete_file, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def _batch_request(body: dict[str, Any]) -> dict[str, str] | None:
    """The body of `POST /v1/batches` checked; its metadata."""
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise APIError(400, f"Missing required parameter: '{name}'.", param=name,
                           code="missing_required_parameter")
    if body["endpoint"] not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {sorted(ENDPOINTS)}.", param="endpoint",
                       code="invalid_value")
    return checked_metadata(body.get("metadata"))


@router.post("/v1/batches", openapi_extra=BATCH_BODY, responses=_documented(BatchObject, "The batch"))
@_errors_as_responses
async def create_batch(request: Request, context: Context, service: Batches):
    caller = counted(context, request)
    body = await json_body.read_object(request)
    metadata = _batch_request(body)
    meta = own_file(service, caller, body["input_file_id"])
    if meta["purpose"] != "batch":
        raise APIError(400, "The input file's purpose must be 'batch'.", param="input_file_id",
                       code="invalid_value")
    content = await asyncio.to_thread(service.store.file_content, meta["id"])
    try:
        manifest, _ = await asyncio.to_thread(
            service.submit, content, caller.tenant, caller.key_id, endpoint=body["endpoint"],
            completion_window=body["completion_window"], input_file_id=meta["id"], input_name=meta["filename"],
            metadata=metadata)
    except BatchRefused as exc:
        raise APIError(exc.status, exc.message, code=exc.code) from None
    except ValueError as exc:
        raise APIError(400, str(exc), param="completion_window", code="invalid_value") from None
    return await current(context, service, manifest["batch_id"])


@router.get("/v1/batches", responses=_documented(BatchList, "The tenant's batches"))
@_errors_as_responses
async def list_batches(request: Request, context: Context, service: Batches, limit: int = 20,
                       after: str | None = None):
    caller = counted(context, request)
    with context.read_limits.lookups.take(caller.tenant_id):
        manifests = await asyncio.to_thread(service.store.list_batches, caller.tenant_id)
        if after:
            ids_ = [m["batch_id"] for m in manifests]
            manifests = manifests[ids_.index(after) + 1:] if after in ids_ else []
        page = manifests[:max(1, min(limit, 100))]
        data = [await current(context, service, m["batch_id"]) for m in page]
    answer = {"object": "list", "data": data, "has_more": len(manifests) > len(page)}
    if data:  # OpenAI's schema types these as strings: an empty page has none
        answer.update(first_id=data[0]["id"], last_id=data[-1]["id"])
    return answer


@router.get("/v1/batches/{batch_id}", responses=_documented(BatchObject, "The batch"))
@_errors_as_responses
async def retrieve_batch(batch_id: str, request: Request, context: Context, service: Batches):
    caller = counted(context, request)
    own_batch(service, caller, batch_id)
    with context.read_limits.lookups.take(caller.tenant_id):
        return await current(context, service, batch_id)


@router.post("/v1/batches/{batch_id}/cancel", responses=_documented(BatchObject, "The batch, cancelling"))
@_errors_as_responses
async def cancel_batch(batch_id: str, request: Request, context: Context, service: Batches):
    own_batch(service, counted(context, request), batch_id)
    await context.kafka_reads.run(service.cancel, batch_id)  # reads `batch-results` (refresh)
    return await current(context, service, batch_id)
