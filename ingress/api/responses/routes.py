"""OpenAI's Responses API: `POST /v1/responses` (plain and streamed), `GET` and `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.

A turn runs as a chat completion of the conversation so far (ingress/api/responses/protocol.py): admission,
quota, queueing and billing see the whole rebuilt prompt, and the prefix cache makes the repeated history
cheap (`usage.input_tokens_details.cached_tokens`). A stored response (``store``, the default) is one event
on the compacted `responses` topic, written before the answer's last byte leaves, so any ingress process can
return it or continue the conversation (ingress/api/responses/store.py).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from ingress.serving.request_stream import RequestStream
from ingress.api.responses.background_replies import BackgroundReplies
from infra.openai_errors import APIError
from ingress.serving.request_view import RequestView
from ingress.serving.tool_calls import ToolCallParser
from ingress.http.openapi_contract import STREAMABLE
from ingress.protocol import openapi_body
from ingress.api.responses.store import ConversationNotFound, input_items
from ingress.api.responses.protocol import ResponsesRequest
from schemas import codec, topics

# The longest a lookup waits for this ingress's view of `responses` to read up to the topic's end.
STORE_WAIT_S = 2.0


def _usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def output_items(record: dict[str, Any], item_id: str, status: str) -> list[dict[str, Any]]:
    """The answer's output items: its message (left out when the answer is only function calls), then its
    function calls."""
    calls = json.loads(record["output_calls_json"])
    items = [] if calls and not record["output_text"] else [_message(item_id, record["output_text"], status)]
    return items + [{"id": "fc_" + c["call_id"].removeprefix("call_"), "status": "completed", **c} for c in calls]


def history_items(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One stored turn as a later turn's history: its input items, then its answer, in stored form."""
    answer = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": record["output_text"]}]}]
    calls = json.loads(record["output_calls_json"])
    if calls and not record["output_text"]:
        answer = []
    return input_items(record) + answer + calls


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def response_object(record: dict[str, Any], status: str | None = None, output: list | None = None) -> dict[str, Any]:
    """The Response object of a stored (or about to be stored) response record."""
    status = status or record["status"]
    item_id = "msg_" + record["response_id"].removeprefix("resp_")
    done = status in ("completed", "incomplete")
    if output is None and not done:
        output = [] if not record["output_text"] else [_message(item_id, record["output_text"], "incomplete")]
    if output is None:
        output = output_items(record, item_id, "completed" if status == "completed" else "incomplete")
    return {
        "id": record["response_id"], "object": "response", "created_at": record["created_at"], "status": status,
        "background": record["background"],
        "error": ({"code": record["error_message"].split(":", 1)[0], "message": record["error_message"]}
                  if record["status"] == "failed" and record["error_message"] else None),
        "incomplete_details": {"reason": record["incomplete_reason"]} if status == "incomplete" else None,
        "instructions": record["instructions"], "max_output_tokens": record["max_output_tokens"],
        "model": record["model"], "output": output, "parallel_tool_calls": True,
        "previous_response_id": record["previous_response_id"], "store": record.get("store", True),
        "temperature": record["temperature"], "top_p": record["top_p"], "text": json.loads(record["text_json"]),
        "tool_choice": json.loads(record["tool_choice_json"]), "tools": json.loads(record["tools_json"]),
        "truncation": "disabled", "user": record.get("user"),
        "metadata": json.loads(record["metadata_json"]),
        "usage": _usage(record["input_tokens"], record["output_tokens"], record["cached_tokens"]) if done else None,
    }


class Turn:
    """One response: its record, filled in as the answer streams, and how it is written out. A new turn
    (`Turn.new`) or a background one read back from Kafka (`Turn(ingress, stored record, replay stream)`)."""

    def __init__(self, ingress, record: dict[str, Any], stream, store: bool = True, user: str | None = None) -> None:
        self.ingress, self.record, self.stream = ingress, record, stream
        self.store, self.user = store, user
        self.item_id = "msg_" + record["response_id"].removeprefix("resp_")
        self.sequence = 0
        # the answer may call tools: its text is read as calls at the end (ingress/serving/tool_calls.py)
        self.calls_tools = json.loads(record["tools_json"]) != [] and json.loads(record["tool_choice_json"]) != "none"

    @classmethod
    def new(cls, ingress, caller, body: ResponsesRequest, stream) -> "Turn":
        record = codec.new_event(
            "StoredResponse", request_id=stream.request_id, response_id=stream.view.response_id,
            tenant_id=caller.tenant_id, deleted=False, model=body.model, created_at=int(time.time()),
            status="queued" if body.background else "completed", incomplete_reason=None,
            previous_response_id=body.previous_response_id, instructions=body.instructions,
            input_items_json=json.dumps(body.input_items()),
            tools_json=json.dumps([t.model_dump(exclude_none=True) for t in body.tools or []]),
            tool_choice_json=json.dumps(body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
                                        else body.tool_choice or "auto"),
            output_text="", metadata_json=json.dumps(body.metadata or {}), max_output_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p, input_tokens=stream.view.prompt_tokens,
            output_tokens=0, cached_tokens=0, background=body.background,
            reply_partition=stream.record["reply_partition"] if body.background else -1,
            created_at_ms=stream.record["arrived_at_ms"], error_message=None,
            text_json=json.dumps(body.text.echo() if body.text else {"format": {"type": "text"}}))
        return cls(ingress, record, stream, body.store, body.user)

    def settle(self) -> dict[str, Any]:
        """Fill in the answer once the request finished; the Response object."""
        view = self.stream.view
        choice = view.choices[0]
        usage = view.usage()
        text, calls = "".join(choice.text), []
        if self.calls_tools:
            parser = ToolCallParser("call_" + self.record["request_id"][:16] + "_0")
            parser.feed(text)
            parser.finish()
            text = parser.text
            calls = [{"type": "function_call", "call_id": c["id"], "name": c["name"], "arguments": c["arguments"]}
                     for c in parser.calls]
        self.record.update(output_text=text, output_calls_json=json.dumps(calls), input_tokens=usage["prompt_tokens"],
                           output_tokens=usage["completion_tokens"], cached_tokens=view.cached_tokens)
        if choice.finish_reason == "length":
            self.record.update(status="incomplete", incomplete_reason="max_output_tokens")
        return self.view_of()

    def view_of(self, status: str | None = None, output: list | None = None) -> dict[str, Any]:
        obj = response_object(self.record, status, output)
        obj["store"] = self.store
        obj["user"] = self.user
        return obj

    def fail(self, err: APIError) -> dict[str, Any]:
        self.record.update(status="failed", error_message=f"{err.code or err.error_type}: {err.message}")
        return self.view_of()

    async def save(self) -> None:
        if not self.store:
            return
        await self.ingress.producer.send(topics.RESPONSES.name, self.record["response_id"], "StoredResponse",
                                         self.record)
        self.ingress.responses.apply(self.record)  # read-your-writes on this process, before the follower

    async def whole(self):
        failed = await self.stream.collect()
        if failed is not None:
            return failed
        obj = self.settle()
        await self.save()
        return JSONResponse(obj, headers=self.stream.headers)


class ResponseFrames:
    """The Responses API's typed stream events, numbered in order (`sequence_number`)."""

    def __init__(self, turn: Turn, starting_after: int = -1):
        self.turn = turn
        self.starting_after = starting_after  # a resumed stream sends only the events after this one

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.turn.sequence, **fields}
        self.turn.sequence += 1
        if data["sequence_number"] <= self.starting_after:
            return ""
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def opening(self) -> list[str]:
        turn = self.turn
        in_progress = turn.view_of("in_progress", output=[])
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        created = turn.view_of("queued", output=[]) if turn.record["background"] else in_progress
        started = [self._event("response.created", response=created),
                   self._event("response.in_progress", response=in_progress)]
        if turn.calls_tools:
            return started  # whether the answer is text or calls is known at its end: items come then
        return started + [
            self._event("response.output_item.added", output_index=0,
                        item=_message(turn.item_id, "", "in_progress")),
            self._event("response.content_part.added", item_id=turn.item_id, output_index=0, content_index=0,
                        part=part),
        ]

    def delta(self, index: int, text: str, finish_reason: str | None) -> list[str]:
        if not text or self.turn.calls_tools:
            return []
        return [self._event("response.output_text.delta", item_id=self.turn.item_id, output_index=0,
                            content_index=0, delta=text, logprobs=[])]

    async def finished(self) -> list[str]:
        turn = self.turn
        obj = turn.settle()
        await turn.save()
        text = turn.record["output_text"]
        item = obj["output"][0]
        ending = "response.completed" if obj["status"] == "completed" else "response.incomplete"
        if turn.calls_tools:
            return [*self._items(obj["output"]), self._event(ending, response=obj)]
        return [
            self._event("response.output_text.done", item_id=turn.item_id, output_index=0, content_index=0,
                        text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=turn.item_id, output_index=0, content_index=0,
                        part=item["content"][0]),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(ending, response=obj),
        ]

    def _items(self, output: list[dict[str, Any]]) -> list[str]:
        """Whole output items, each announced, filled in one piece and closed."""
        frames = []
        for index, item in enumerate(output):
            if item["type"] == "function_call":
                frames += [
                    self._event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                          "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"]),
                ]
            else:
                part = item["content"][0]
                frames += [
                    self._event("response.output_item.added", output_index=index,
                                item={**item, "status": "in_progress", "content": []}),
                    self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part={**part, "text": ""}),
                    self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                content_index=0, delta=part["text"], logprobs=[]),
                    self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part),
                ]
            frames.append(self._event("response.output_item.done", output_index=index, item=item))
        return frames

    def error(self, err: APIError) -> list[str]:
        return [self._event("response.failed", response=self.turn.fail(err))]

    def closing(self) -> list[str]:
        return []


class ReplayStream(RequestStream):
    """A background response's reply events read back from `batch-results` (ingress/api/responses/background_replies.py),
    shaped like a live request's stream, so polling and (re)streaming use the same code as a live turn."""

    def __init__(self, ingress, http: Request, stored: dict[str, Any], wait_s: float):
        # Not RequestStream.__init__: nothing is registered, reserved or cancelled here.
        self.ingress, self.http = ingress, http
        self.record = {"request_id": stored["request_id"], "tenant_id": stored["tenant_id"]}
        self.view = RequestView(response_id=stored["response_id"], model=stored["model"], chat=True, n=1,
                                prompt_tokens=stored["input_tokens"])
        self.replies: BackgroundReplies | None = None
        self._stored = stored
        self._pending: list[tuple[str, dict]] = []
        self.deadline = time.monotonic() + wait_s
        self.ended = False

    async def open(self) -> None:
        s = self._stored
        self.replies = await asyncio.to_thread(BackgroundReplies, s["request_id"], s["reply_partition"],
                                               s["created_at_ms"], f"{self.ingress.settings.process_id}-background")

    async def read_to_end(self) -> list[tuple[str, dict]]:
        return await asyncio.to_thread(self.replies.read_to_end)

    async def next_event(self):
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
            current = self.ingress.responses.get(self._stored["tenant_id"], self._stored["response_id"])
            if current is not None and current["status"] == "cancelled":
                raise APIError(409, "The response was cancelled.", code="response_cancelled")
            self._pending += await asyncio.to_thread(self.replies.read, 0.5)
        return self._pending.pop(0)

    def observe_tokens(self) -> None:
        pass

    def finish(self, cancelled: bool) -> None:
        if not self.ended:
            self.ended = True
            if self.replies is not None:
                self.replies.close()

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self._stored["request_id"]}


FINAL = ("completed", "incomplete", "cancelled", "failed")


def responses_router(ingress) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest), responses=STREAMABLE)
    async def create_response(request: Request):
        arrived_ms = int(time.time() * 1000)
        caller = ingress.authenticate(request)
        ingress.tenancy.admission.precheck(caller)
        body = await ingress.parse(request, ResponsesRequest)
        unsupported = body.unsupported()
        if unsupported:
            raise APIError(400, f"'{unsupported}' is not supported by this server yet.", code="unsupported_parameter",
                           param=unsupported)
        ingress.resolve_model(caller, body.model)
        history: list[list[dict]] = []
        if body.previous_response_id:
            await ingress.response_follower.settled(STORE_WAIT_S)
            try:
                turns = ingress.serving.request_view.chain(caller.tenant_id, body.previous_response_id)
            except ConversationNotFound as missing:
                raise APIError(404, f"Previous response with id '{missing.response_id}' not found.",
                               code="previous_response_not_found", param="previous_response_id") from None
            history = [history_items(t) for t in turns]
        try:
            stream = await ingress.submit(request, caller, body.chat_request(history), True, arrived_ms,
                                          id_prefix="resp_", background=body.background)
        except APIError as err:
            if err.param == "messages":
                err.param = "input"
            elif err.param and err.param.startswith("response_format"):  # where the Responses API has it
                err.param = "text.format" + err.param.removeprefix("response_format").removeprefix(".json_schema")
            elif err.param and err.param.startswith("tool_choice.function"):
                err.param = "tool_choice" + err.param.removeprefix("tool_choice.function")
            raise
        turn = Turn.new(ingress, caller, body, stream)
        if body.background:
            await turn.save()
            if body.stream:  # the same stream `GET ?stream=true` replays, so it resumes with `starting_after`
                return await _replay(request, turn.record, body.timeout or caller.tenant["default_deadline_s"],
                                     stream=True)
            return JSONResponse(turn.view_of(), headers={"X-Request-Id": stream.request_id})
        if body.stream:
            return await stream.sse(ResponseFrames(turn))
        return await turn.whole()

    async def _stored(request: Request, response_id: str) -> tuple[Any, dict]:
        caller = ingress.authenticate(request)
        await ingress.response_follower.settled(STORE_WAIT_S)
        record = ingress.serving.request_view.get(caller.tenant_id, response_id)
        if record is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found",
                           param="response_id")
        return caller, record

    @router.get("/v1/responses/{response_id}", responses=STREAMABLE)
    async def retrieve_response(request: Request, response_id: str, stream: bool = False,
                                starting_after: Annotated[int, Query(ge=-1)] = -1):
        caller, record = await _stored(request, response_id)
        if not record["background"]:
            if stream:
                raise APIError(400, "Only background responses can be streamed again.", code="response_not_background",
                               param="stream")
            return response_object(record)
        if record["status"] in ("cancelled", "failed") or (record["status"] in FINAL and not stream):
            return response_object(record)
        return await _replay(request, record, caller.tenant["default_deadline_s"], stream, starting_after)

    async def _replay(request: Request, record: dict, deadline_s: float, stream: bool, starting_after: int = -1):
        """A background response as it stands, or (`stream`) its event stream, read back from Kafka: from its
        start, on whichever process is asked."""
        replay = ReplayStream(ingress, request, dict(record), deadline_s + 60)
        turn = Turn(ingress, dict(record), replay)
        if stream:  # opened by its first read, inside the stream: the response exists whatever happens there
            return await replay.sse(ResponseFrames(turn, starting_after), headers_first=True)
        await replay.open()
        try:
            for kind, payload in await replay.read_to_end():
                if kind == "error":
                    obj = turn.fail(replay.error_from_event(payload))
                    await turn.save()
                    return obj
                replay.view.apply(payload)
        finally:
            replay.finish(cancelled=False)
        if replay.view.finished:
            obj = turn.settle()
            await turn.save()  # whoever sees it end first writes the final record; later writes are the same
            return obj
        text = "".join(replay.view.choices[0].text)
        turn.record["output_text"] = text
        return turn.view_of("in_progress" if text else "queued")

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str):
        caller, record = await _stored(request, response_id)
        if not record["background"]:
            raise APIError(400, "Only background responses can be cancelled.", code="response_not_background",
                           param="response_id")
        if record["status"] in FINAL:
            return response_object(record)
        cancel = codec.new_event("RequestCancelled", request_id=record["request_id"], tenant_id=caller.tenant_id,
                                 reason="client_cancelled")
        await ingress.producer.send(topics.CANCELLATIONS.name, record["request_id"], "RequestCancelled", cancel)
        turn = Turn(ingress, dict(record, status="cancelled"), None)
        await turn.save()
        return turn.view_of()

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        caller, record = await _stored(request, response_id)
        tombstone = codec.new_event("StoredResponse", response_id=response_id, tenant_id=caller.tenant_id,
                                    deleted=True)
        await ingress.producer.send(topics.RESPONSES.name, response_id, "StoredResponse", tombstone)
        ingress.serving.request_view.apply(codec.decode(*codec.encode("StoredResponse", tombstone)).record)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(request: Request, response_id: str, order: Literal["asc", "desc"] = "desc",
                               limit: Annotated[int, Query(ge=1, le=100)] = 20):
        _, record = await _stored(request, response_id)
        base = record["response_id"].removeprefix("resp_")
        items = [{"id": f"msg_{base}_in{i}", **item} for i, item in enumerate(input_items(record))]
        if order == "desc":
            items.reverse()
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    return router
