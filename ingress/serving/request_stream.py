"""One request's reply events on their way to the client, exactly once: whole (`whole`, `collect`) or as
server-sent events written by the endpoint's `Frames`. Where the events come from is an `EventSource`:
live from this process's reply partition (`LiveReplies`, which also settles what the request's end
settles: edge reservation, metrics, a cancellation when the client left), or read back from Kafka (a
background response, ingress/api/responses/replay.py)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from http_api.openai_errors import APIError
from ingress.http.stalled_reader import WriteTimedStreamingResponse
from ingress.kafka.producer import AsyncProducer
from ingress.kafka.reply_events import ReplyEvent
from ingress.kafka.reply_router import ReplyRouter
from ingress.metrics import IngressMetrics
from ingress.serving.request_view import RequestView
from ingress.tenancy.admission import EdgeAdmission, Reservation
from schemas import codec, topics
from schemas.records import ReplyItem, RequestError

log = logging.getLogger("tokenmill.ingress")


class EventSource(Protocol):
    """Where one request's reply events come from."""
    record: dict[str, Any]  # the request: at least its request_id and tenant_id

    @property
    def headers(self) -> dict[str, str]: ...

    async def next_event(self) -> ReplyEvent | None:
        """The next event; None when the client left; raises APIError when none will come in time."""

    def tokens_delivered(self) -> None:
        """Tokens of the answer went out to the client."""

    def end(self, view: RequestView, cancelled: bool) -> None:
        """The stream ended (called once)."""


class Frames(Protocol):
    """How one endpoint writes its event stream."""

    def opening(self) -> list[str]: ...

    def delta(self, index: int, text: str, finish_reason: str | None) -> list[str]: ...

    async def finished(self) -> list[str]: ...

    def error(self, err: APIError) -> list[str]: ...

    def closing(self) -> list[str]: ...


def error_from_event(err: RequestError) -> APIError:
    headers = {}
    retry_after_s = err.get("retry_after_s")
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return APIError(err["status_code"], err["message"], code=err.get("code"), error_type=err["error_type"],
                    headers=headers)


@dataclass(frozen=True)
class StreamServices:
    """What a live request's end settles, shared by every live stream of the process."""
    metrics: IngressMetrics
    admission: EdgeAdmission
    replies: ReplyRouter
    producer: AsyncProducer


class LiveReplies:
    """A request's events from this process's reply partition (the reply router fills `queue`)."""

    def __init__(self, services: StreamServices, http: Request, record: dict, queue: asyncio.Queue[ReplyEvent],
                 reservation: Reservation, wait_s: float):
        self.services, self.http, self.record = services, http, record
        self.queue, self.reservation = queue, reservation
        self.deadline = time.monotonic() + wait_s
        # TTFT counts from the request's arrival at ingress, before tokenizing and queueing.
        self.started = time.monotonic() - max(0.0, time.time() - record["arrived_at_ms"] / 1000)
        self.last_token_at: float | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.record["request_id"], **self.reservation.headers}

    async def next_event(self) -> ReplyEvent | None:
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                # Accepted, then never finished: a request the platform lost or could not serve in time,
                # the one outcome an operator must be able to follow (the worker logs each start by this id).
                log.warning("request %s timed out %s", self.record["request_id"],
                            "after its first token" if self.last_token_at is not None else "before its first token")
                raise APIError(504, "The request timed out before it finished.", code="timeout")
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                if await self.http.is_disconnected():
                    return None

    def tokens_delivered(self) -> None:
        now = time.monotonic()
        model = self.record["model"]
        if self.last_token_at is None:
            self.services.metrics.ttft.labels(model).observe(now - self.started)
        else:
            self.services.metrics.itl.labels(model).observe(now - self.last_token_at)
        self.last_token_at = now

    def end(self, view: RequestView, cancelled: bool) -> None:
        metrics, model, request_id = self.services.metrics, view.model, self.record["request_id"]
        if view.finished:
            usage = view.usage()
            metrics.e2e.labels(model).observe(time.monotonic() - self.started)
            metrics.requests.labels(model, view.choices[0].finish_reason or "stop").inc()
            metrics.prompt_tokens.labels(model).inc(usage["prompt_tokens"])
            metrics.generation_tokens.labels(model).inc(usage["completion_tokens"])
        elif cancelled:
            metrics.cancellations.labels(model).inc()
        self.services.replies.unregister(request_id)
        if view.finished:
            usage = view.usage()
            self.services.admission.settle(self.reservation, usage["prompt_tokens"], usage["completion_tokens"],
                                           view.cached_tokens)
        else:
            self.services.admission.release(self.reservation)
        if cancelled:
            cancel = codec.new_event("RequestCancelled", request_id=request_id,
                                     tenant_id=self.record["tenant_id"], reason="client_disconnected")
            self.services.producer.send_nowait(topics.CANCELLATIONS.name, request_id, "RequestCancelled", cancel)


class RequestStream:
    """Reads one request's events from its source into its view, and writes them out, once."""

    def __init__(self, source: EventSource, view: RequestView):
        self.source, self.view = source, view
        self.ended = False

    @property
    def record(self) -> dict[str, Any]:
        return self.source.record

    @property
    def request_id(self) -> str:
        return self.source.record["request_id"]

    @property
    def headers(self) -> dict[str, str]:
        return self.source.headers

    def finish(self, cancelled: bool) -> None:
        if not self.ended:
            self.ended = True
            self.source.end(self.view, cancelled)

    def _apply(self, payload: ReplyItem) -> tuple[int, str, str | None] | None:
        applied = self.view.apply(payload)
        if applied is not None and payload["token_ids"]:
            self.source.tokens_delivered()
        return applied

    async def collect(self) -> Response | None:
        """Read reply events until the request finished: None when it did, else what to answer instead
        (its error, or 499 when the client left)."""
        try:
            while not self.view.finished:
                event = await self.source.next_event()
                if event is None:
                    self.finish(cancelled=True)
                    return Response(status_code=499)
                if event[0] == "error":
                    self.finish(cancelled=False)
                    return self._identified(error_from_event(event[1])).response()
                self._apply(event[1])
            self.finish(cancelled=False)
            return None
        except APIError as err:
            self.finish(cancelled=True)
            self._identified(err)
            raise
        except asyncio.CancelledError:
            self.finish(cancelled=True)
            raise

    def _identified(self, err: APIError) -> APIError:
        """An accepted request's error names the request, as OpenAI's do (X-Request-Id), so a caller can
        quote it and an operator can find it in the logs."""
        err.headers = {"X-Request-Id": self.request_id, **err.headers}
        return err

    async def whole(self):
        failed = await self.collect()
        if failed is not None:
            return failed
        return JSONResponse(self.view.body(), headers=self.headers)

    async def sse(self, frames: Frames, headers_first: bool = False):
        """Stream the reply as server-sent events, written by `frames` (the endpoint's event format).

        By default the first event is awaited before the headers go out, so a request rejected or shed
        before it started gets a real HTTP status (429/503) rather than a broken stream. A response that
        already exists whatever happens next (a background one) streams at once (`headers_first`): its
        failure is an event in the stream."""
        first = None
        if not headers_first:
            try:
                first = await self.source.next_event()
            except APIError as err:
                self.finish(cancelled=True)
                self._identified(err)
                raise
            except BaseException:
                self.finish(cancelled=True)
                raise
            if first is None:
                self.finish(cancelled=True)
                return Response(status_code=499)
            if first[0] == "error":
                self.finish(cancelled=False)
                return self._identified(error_from_event(first[1])).response()
        return WriteTimedStreamingResponse(self._written(frames, first), media_type="text/event-stream",
                                           headers={"Cache-Control": "no-cache", **self.headers})

    async def _written(self, frames: Frames, first: ReplyEvent | None) -> AsyncIterator[str]:
        try:
            for frame in frames.opening():
                yield frame
            async for frame in self._events_written(frames, first):
                yield frame
        except APIError as err:
            for frame in [*frames.error(err), *frames.closing()]:
                yield frame
            self.finish(cancelled=True)
        finally:
            # Reached when the client disconnects mid-stream (the generator is closed).
            self.finish(cancelled=not self.view.finished)

    async def _events_written(self, frames: Frames, event: ReplyEvent | None) -> AsyncIterator[str]:
        while True:
            if event is None:
                event = await self.source.next_event()
                if event is None:
                    self.finish(cancelled=True)
                    return
            if event[0] == "error":
                for frame in frames.error(error_from_event(event[1])):
                    yield frame
                break
            applied = self._apply(event[1])
            if applied is not None:
                for frame in frames.delta(*applied):
                    yield frame
            if self.view.finished:
                for frame in await frames.finished():
                    yield frame
                break
            event = None
        for frame in frames.closing():
            yield frame
        self.finish(cancelled=False)


class CompletionFrames:
    """Chat and text completions' stream: `data:` chunks, then `[DONE]` (the Responses API has its own,
    ingress/api/responses/frames.py)."""

    def __init__(self, view: RequestView, include_usage: bool):
        self.view, self.include_usage = view, include_usage

    def opening(self) -> list[str]:
        return []

    def delta(self, index: int, text: str, finish_reason: str | None) -> list[str]:
        if text or finish_reason or index not in self.view.role_sent:
            return [f"data: {json.dumps(self.view.chunk(index, text, finish_reason))}\n\n"]
        return []

    async def finished(self) -> list[str]:
        return [f"data: {json.dumps(self.view.usage_chunk())}\n\n"] if self.include_usage else []

    def error(self, err: APIError) -> list[str]:
        return [f"data: {json.dumps(err.body())}\n\n"]

    def closing(self) -> list[str]:
        return ["data: [DONE]\n\n"]
