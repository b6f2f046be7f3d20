"""The text completions route."""
from __future__ import annotations

from fastapi import APIRouter, Request

from ingress.api.completions.serving import TextCompletionServing
from ingress.context import Context
from ingress.http.openapi_contract import STREAMABLE
from ingress.protocol import CompletionRequest, openapi_body

router = APIRouter()


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest), responses=STREAMABLE)
async def completions(request: Request, context: Context):
    return await TextCompletionServing(context).create(request)
