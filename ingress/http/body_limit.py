"""Request body limits enforced on the bytes actually received, at the ASGI level.

A Content-Length header is only a claim: a chunked upload has none, and Starlette spools a
multipart body to disk before a route sees it. This middleware counts the body as it arrives and
stops at the limit with a 413, whatever the route does with it (JSON, forms, files).
"""
from __future__ import annotations

from typing import Callable

from http_api.openai_errors import APIError


class BodyLimit:
    def __init__(self, app, limit_for: Callable[[str], tuple[int, str]]):
        self.app = app
        self.limit_for = limit_for  # path -> (bytes allowed, error code)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, code = self.limit_for(scope["path"])
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise APIError(413, f"Request body exceeds {limit} bytes.", code=code)
            return message

        await self.app(scope, counted, send)
