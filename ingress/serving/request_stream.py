"""One request's reply events on their way to the client, exactly once: whole (`whole`, `collect`) or as
server-sent events written by the endpoint's `SseFrames`; and what its end settles (edge reservation,
metrics, a cancellation when the client left)."""
from __future__ import annotations

import asyncio
import json
import time

from fastapi.responses import JSONResponse, Response, StreamingResponse

from infra.openai_errors import APIError
from ingress.serving.request_view import RequestView
from schemas import codec, topics


class RequestStream:
    """Waits for one request's reply events and writes them out, once."""

    def __init__(self, ingress, http, record: dict, view: RequestView,
                 queue: asyncio.Queue, reservation, wait_s: float):
        self.ingress, self.http, self.record, self.view = ingress, http, record, view
        self.queue, self.reservation = queue, reservation
        self.deadline = time.monotonic() + wait_s
        self.ended = False
        # TTFT counts from the request's arrival at ingress, before tokenizing and queueing.
        self.started = time.monotonic() - max(0.0, time.time() - record["arrived_at_ms"] / 1000)
        self.last_token_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.record["request_id"]

    async def next_event(self):
        """The next reply event; raises APIError on timeout, returns None if the client left."""
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise APIError(504, "The request timed out before it finished.", code="timeout")
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                if await self.http.is_disconnected():
                    return None

    def observe_tokens(self) -> None:
        now = time.monotonic()
        model = self.view.model
        if self.last_token_at is None:
            self.ingress.metrics.ttft.labels(model).observe(now - self.started)
        else:
            self.ingress.metrics.itl.labels(model).observe(now - self.last_token_at)
        self.last_token_at = now

    def finish(self, cancelled: bool) -> None:
        if self.ended:
            return
        self.ended = True
        metrics, model = self.ingress.metrics, self.view.model
        if self.view.finished:
            usage = self.view.usage()
            metrics.e2e.labels(model).observe(time.monotonic() - self.started)
            metrics.requests.labels(model, self.view.choices[0].finish_reason or "stop").inc()
            metrics.prompt_tokens.labels(model).inc(usage["prompt_tokens"])
            metrics.generation_tokens.labels(model).inc(usage["completion_tokens"])
        elif cancelled:
            metrics.cancellations.labels(model).inc()
        self.ingress.router.unregister(self.request_id)
        if self.view.finished:
            usage = self.view.usage()
            self.ingress.admission.settle(self.reservation, usage["prompt_tokens"], usage["completion_tokens"],
                                          self.view.cached_tokens)
        else:
            self.ingress.admission.release(self.reservation)
        if cancelled:
            cancel = codec.new_event("RequestCancelled", request_id=self.request_id,
                                     tenant_id=self.record["tenant_id"], reason="client_disconnected")
            self.ingress.producer.send_nowait(topics.CANCELLATIONS.name, self.request_id, "RequestCancelled", cancel)

    @staticmethod
    def error_from_event(err: dict) -> APIError:
        headers = {}
        if err.get("retry_after_s") is not None:
            headers["Retry-After"] = str(max(1, round(err["retry_after_s"])))
        return APIError(err["status_code"], err["message"], code=err.get("code"), error_type=err["error_type"],
                        headers=headers)

    async def collect(self) -> Response | None:
        """Read reply events until the request finished: None when it did, else what to answer instead
        (its error, or 499 when the client left)."""
        try:
            while not self.view.finished:
                event = await self.next_event()
                if event is None:
                    self.finish(cancelled=True)
                    return Response(status_code=499)
                kind, payload = event
                if kind == "error":
                    self.finish(cancelled=False)
                    return self.error_from_event(payload).response()
                if self.view.apply(payload) is not None and payload["token_ids"]:
                    self.observe_tokens()
            self.finish(cancelled=False)
            return None
        except APIError:
            self.finish(cancelled=True)
            raise
        except asyncio.CancelledError:
            self.finish(cancelled=True)
            raise

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id, **self.reservation.headers}

    async def whole(self):
        failed = await self.collect()
        if failed is not None:
            return failed
        return JSONResponse(self.view.body(), headers=self.headers)

    async def sse(self, frames: "SseFrames", headers_first: bool = False):
        """Stream the reply as server-sent events, written by `frames` (the endpoint's event format).

        By default the first event is awaited before the headers go out, so a request rejected or shed
        before it started gets a real HTTP status (429/503) rather than a broken stream. A response that
        already exists whatever happens next (a background one) streams at once (`headers_first`): its
        failure is an event in the stream."""
        first = None
        if not headers_first:
            try:
                first = await self.next_event()
            except BaseException:
                self.finish(cancelled=True)
                raise
            if first is None:
                self.finish(cancelled=True)
                return Response(status_code=499)
            if first[0] == "error":
                self.finish(cancelled=False)
                return self.error_from_event(first[1]).response()

        async def body():
            event = first
            try:
                for frame in frames.opening():
                    yield frame
                if event is None:
                    event = await self.next_event()
                    if event is None:
                        self.finish(cancelled=True)
                        return
                while True:
                    kind, payload = event
                    if kind == "error":
                        for frame in frames.error(self.error_from_event(payload)):
                            yield frame
                        break
                    applied = self.view.apply(payload)
                    if applied is not None:
                        if payload["token_ids"]:
                            self.observe_tokens()
                        for frame in frames.delta(*applied):
                            yield frame
                    if self.view.finished:
                        for frame in await frames.finished():
                            yield frame
                        break
                    event = await self.next_event()
                    if event is None:
                        self.finish(cancelled=True)
                        return
                for frame in frames.closing():
                    yield frame
                self.finish(cancelled=False)
            except APIError as err:
                for frame in [*frames.error(err), *frames.closing()]:
                    yield frame
                self.finish(cancelled=True)
            finally:
                # Reached when the client disconnects mid-stream (the generator is closed).
                self.finish(cancelled=not self.view.finished)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **self.headers})


class SseFrames:
    """How one endpoint writes its stream: chat and text completions here (`data:` chunks, then
    `[DONE]`); the Responses API has its own (ingress/api/responses/routes.py)."""

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
