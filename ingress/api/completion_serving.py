"""What chat and text completions share: authenticate, refuse a tenant already out of quota, parse,
submit, then answer whole or as a stream of `data:` chunks. Each API is a subclass naming its body and
its prompt kind (ingress/api/chat/serving.py, ingress/api/completions/serving.py)."""
from __future__ import annotations

from typing import ClassVar

from starlette.requests import Request

from ingress.context import IngressContext
from ingress.http import json_body
from ingress.protocol import CompletionBody
from ingress.serving.prompts import PromptKind
from ingress.serving.request_stream import CompletionFrames
from ingress.serving.submitter import now_ms


class CompletionServing:
    body_type: ClassVar[type[CompletionBody]]
    prompt: ClassVar[PromptKind]

    def __init__(self, context: IngressContext):
        self.context = context

    async def create(self, request: Request):
        arrived_ms = now_ms()
        ctx = self.context
        caller = ctx.authenticator.caller(request.headers)
        ctx.admission.precheck(caller)
        body = await json_body.parse(request, self.body_type)
        stream = await ctx.submitter.submit(request, caller, body, self.prompt, arrived_ms)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream.sse(CompletionFrames(stream.view, include_usage))
        return await stream.whole()
