"""SSE responses whose writes time out: a client that stops reading gives its stream up.

A reader that stops reading (a hung browser tab, a proxy holding the connection) makes each write
wait for the socket to drain, for ever. Meanwhile its stream keeps its edge slot, its reply router
buffer and, for a replay, its Kafka consumer, well past its deadline. Each write here waits at most
TOKENMILL_SSE_WRITE_TIMEOUT_S; past that the stream ends as if the client had left (the body's
generator is closed, so whatever a departure releases is released) and the connection is dropped."""
from __future__ import annotations

import asyncio
import logging

from fastapi.responses import StreamingResponse

from infra import settings

log = logging.getLogger("tokenmill.ingress.sse")


def sse_write_timeout_s() -> float:
    return settings.SSE_WRITE_TIMEOUT_S.get()


class ClientStalled(Exception):
    pass


class WriteTimedStreamingResponse(StreamingResponse):
    def __init__(self, *args, write_timeout_s: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.write_timeout_s = sse_write_timeout_s() if write_timeout_s is None else write_timeout_s

    async def stream_response(self, send) -> None:
        async def timed_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except asyncio.TimeoutError:
                raise ClientStalled() from None

        try:
            await super().stream_response(timed_send)
        except ClientStalled:
            log.warning("an SSE client stopped reading for %.3g s: its stream is given up", self.write_timeout_s)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # now, not at garbage collection: its finally releases what it holds
