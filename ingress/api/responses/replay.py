"""A background response's reply events read back from `batch-results` (background_replies.py), as the
event source of a request stream: polling and (re)streaming it use the same code as a live turn. Nothing
is registered, reserved or cancelled here: the request was admitted when it was created."""
from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

from starlette.requests import Request

from http_api.openai_errors import APIError
from ingress.api.responses.background_replies import BackgroundReplies
from ingress.api.responses.store import ResponseStore
from ingress.kafka.reads import KafkaReads
from ingress.kafka.reply_events import ReplyEvent
from ingress.serving.request_stream import RequestStream
from ingress.serving.request_view import ChatView, RequestView
from ingress.tenancy.read_limits import Held
from schemas.records import StoredResponse

# How long a replay waiting for new events sleeps between looks at what its consumer fetched (librdkafka
# fetches in the background; a look takes the read pool's thread for no time at all).
POLL_S = 0.1


class ReplayedReplies:
    """`held`: the tenant's replay slot (read_limits.py), given back when the stream ends, or when this
    source is dropped without ever being read (a response never sent)."""

    def __init__(self, http: Request, stored: StoredResponse, responses: ResponseStore, reads: KafkaReads,
                 wait_s: float, held: Held | None = None):
        self.http, self.stored, self.responses, self.reads = http, stored, responses, reads
        self.record: dict[str, Any] = {"request_id": stored["request_id"], "tenant_id": stored["tenant_id"]}
        self.replies: BackgroundReplies | None = None
        self._pending: list[ReplyEvent] = []
        self.deadline = time.monotonic() + wait_s
        self.held = held
        self._reading: asyncio.Future | None = None  # the read of `replies` under way on the pool
        self._ended = False
        if held is not None:
            weakref.finalize(self, held.release_later)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.record["request_id"]}

    async def open(self) -> None:
        s = self.stored
        opening = asyncio.ensure_future(self.reads.run(BackgroundReplies, s["request_id"], s["reply_partition"],
                                                       s["created_at_ms"], self.reads.consumers))
        try:
            replies = await asyncio.shield(opening)
        except asyncio.CancelledError:  # the client left while its consumer was being set up
            opening.add_done_callback(self._close_unused)
            raise
        if self._ended:
            self.reads.after(None, replies.close)
            return
        self.replies = replies

    def _close_unused(self, opening: asyncio.Future) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self.reads.after(None, opening.result().close)

    async def _on_pool(self, fn, *args):
        reading = self._reading = asyncio.ensure_future(self.reads.run(fn, *args))
        try:
            return await asyncio.shield(reading)
        finally:
            if reading.done() and self._reading is reading:
                self._reading = None

    async def read_to_end(self) -> list[ReplyEvent]:
        """Everything up to the partition's end now; a 503 when that end was not reached in time."""
        assert self.replies is not None
        try:
            return await self._on_pool(self.replies.read_to_end)
        except TimeoutError:
            raise APIError(503, "The response's events could not all be read back in time; retrieve it again.",
                           code="replay_unavailable", headers={"Retry-After": "1"}) from None

    async def next_event(self) -> ReplyEvent | None:
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
            if self.responses.status(self.stored["tenant_id"], self.stored["response_id"]) == "cancelled":
                raise APIError(409, "The response was cancelled.", code="response_cancelled")
            replies = self.replies
            if replies is None:  # ended meanwhile
                return None
            self._pending += await self._on_pool(replies.read, 0)
            if not self._pending:
                await asyncio.sleep(POLL_S)
        return self._pending.pop(0)

    def tokens_delivered(self) -> None:
        pass  # measured when the tokens went out live, if anyone was waiting

    def end(self, view: RequestView, cancelled: bool) -> None:
        self._ended = True
        replies, self.replies = self.replies, None
        if replies is not None:  # its consumer back to the pool, once no read of it is under way
            self.reads.after(self._reading, replies.close)
        if self.held is not None:
            self.held.release()


def replayed_stream(http: Request, stored: StoredResponse, responses: ResponseStore, reads: KafkaReads,
                    wait_s: float, held: Held | None = None) -> tuple[RequestStream, ReplayedReplies]:
    source = ReplayedReplies(http, stored, responses, reads, wait_s, held)
    view = ChatView(response_id=stored["response_id"], model=stored["model"], n=1,
                    prompt_tokens=stored["input_tokens"])
    return RequestStream(source, view), source
