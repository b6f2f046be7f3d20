"""`GET /v1/models`: the models this process serves."""
from __future__ import annotations

from fastapi import APIRouter, Request

from ingress.context import Context

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request, context: Context):
    context.authenticator.caller(request.headers)
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": m.created, "owned_by": "tokenmill",
         "max_model_len": m.max_model_len} for name, m in context.models.items()]}
