"""A background response's reply events read back from `batch-results` (background_replies.py), as the
event source of a request stream: polling and (re)streaming it use the same code as a live turn. Nothing
is registered, reserved or cancelled here: the request was admitted when it was created."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request

from infra.openai_errors import APIError
from ingress.api.responses.background_replies import BackgroundReplies
from ingress.api.responses.store import ResponseStore
from ingress.serving.request_stream import Event, RequestStream
from ingress.serving.request_view import ChatView, RequestView


class ReplayedReplies:
    def __init__(self, http: Request, stored: dict[str, Any], responses: ResponseStore, client_id: str,
                 wait_s: float):
        self.http, self.stored, self.responses, self.client_id = http, stored, responses, client_id
        self.record = {"request_id": stored["request_id"], "tenant_id": stored["tenant_id"]}
        self.replies: BackgroundReplies | None = None
        self._pending: list[Event] = []
        self.deadline = time.monotonic() + wait_s

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.stored["request_id"]}

    async def open(self) -> None:
        s = self.stored
        self.replies = await asyncio.to_thread(BackgroundReplies, s["request_id"], s["reply_partition"],
                                               s["created_at_ms"], f"{self.client_id}-background")

    async def read_to_end(self) -> list[Event]:
        """Everything up to the partition's end now; a 503 when that end was not reached in time."""
        assert self.replies is not None
        try:
            return await asyncio.to_thread(self.replies.read_to_end)
        except TimeoutError:
            raise APIError(503, "The response's events could not all be read back in time; retrieve it again.",
                           code="replay_unavailable", headers={"Retry-After": "1"}) from None

    async def next_event(self) -> Event | None:
        if self.replies is None:
            try:
                await self.open()
            except Exception as exc:  # noqa: BLE001 - Kafka unreachable: this stream ends, the response does not
                raise APIError(503, f"The response's events could not be read back ({type(exc).__name__}); "
                                    "retrieve it later.", code="replay_unavailable") from None
        while not self._pending:
            if time.monotonic() > self.deadline:
                raise APIError(504, "The response did not finish in time.", code="timeout")
            if await self.http.is_disconnected():
                return None
            current = self.responses.get(self.stored["tenant_id"], self.stored["response_id"])
            if current is not None and current["status"] == "cancelled":
                raise APIError(409, "The response was cancelled.", code="response_cancelled")
            self._pending += await asyncio.to_thread(self.replies.read, 0.5)
        return self._pending.pop(0)

    def tokens_delivered(self) -> None:
        pass  # measured when the tokens went out live, if anyone was waiting

    def end(self, view: RequestView, cancelled: bool) -> None:
        if self.replies is not None:
            self.replies.close()


def replayed_stream(http: Request, stored: dict[str, Any], responses: ResponseStore, client_id: str,
                    wait_s: float) -> tuple[RequestStream, ReplayedReplies]:
    source = ReplayedReplies(http, stored, responses, client_id, wait_s)
    view = ChatView(response_id=stored["response_id"], model=stored["model"], n=1,
                    prompt_tokens=stored["input_tokens"])
    return RequestStream(source, view), source
