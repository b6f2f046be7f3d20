"""An SSE write that waits past its timeout gives the stream up, and the stream's generator is closed
at once, so what a departure releases (edge slot, router buffer, replay consumer) is released."""
from __future__ import annotations

import asyncio

from ingress.http.stalled_reader import WriteTimedStreamingResponse

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET", "path": "/", "headers": []}


def _stream(closed: list[str]):
    async def frames():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.append("closed")
    return frames()


async def _receive():
    await asyncio.Event().wait()  # the client sends nothing more


def test_a_client_that_stops_reading_loses_its_stream_and_the_stream_is_closed():
    closed: list[str] = []
    written: list[bytes] = []
    stalled = asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.body" and len(written) >= 3:
            stalled.set()
            await asyncio.Event().wait()  # the socket never drains
        written.append(message.get("body", b""))

    async def run():
        response = WriteTimedStreamingResponse(_stream(closed), media_type="text/event-stream", write_timeout_s=0.2)
        await asyncio.wait_for(response(SCOPE, _receive, send), 30)  # returns: it is not stuck in send

    asyncio.run(run())
    assert stalled.is_set()
    assert closed == ["closed"]
    assert len(written) == 3  # the start and two events went out before the client stalled


def test_a_reader_that_keeps_reading_gets_every_event():
    closed: list[str] = []
    written: list[dict] = []

    async def send(message):
        await asyncio.sleep(0)
        written.append(message)

    async def run():
        response = WriteTimedStreamingResponse(_stream(closed), media_type="text/event-stream", write_timeout_s=0.2)
        await response(SCOPE, _receive, send)

    asyncio.run(run())
    bodies = [m for m in written if m["type"] == "http.response.body"]
    assert len(bodies) == 1001 and bodies[-1]["more_body"] is False
    assert closed == ["closed"]
