"""The chat completions route."""
from __future__ import annotations

from fastapi import APIRouter, Request

from ingress.api.chat.serving import ChatServing
from ingress.context import Context
from ingress.http.openapi_contract import STREAMABLE
from ingress.protocol import ChatCompletionRequest, openapi_body

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest), responses=STREAMABLE)
async def chat_completions(request: Request, context: Context):
    return await ChatServing(context).create(request)
