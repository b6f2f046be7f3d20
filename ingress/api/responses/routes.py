"""OpenAI's Responses API: `POST /v1/responses` (plain and streamed), `GET` and `DELETE
/v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items`.

A turn runs as a chat completion of the conversation so far (protocol.py): admission, quota, queueing and
billing see the whole rebuilt prompt, and the prefix cache makes the repeated history cheap
(`usage.input_tokens_details.cached_tokens`). A stored response (``store``, the default) is one event on the
compacted `responses` topic, written before the answer's last byte leaves, so any ingress process can
return it or continue the conversation (store.py).
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from http_api.openai_errors import APIError
from ingress.api.responses.background_replies import reply_partition
from ingress.api.responses.frames import ResponseFrames
from ingress.api.responses.protocol import ResponsesRequest
from ingress.api.responses.replay import replayed_stream
from ingress.api.responses.follower import ResponseFollower
from ingress.api.responses.store import FINAL_STATUSES, ConversationNotFound, input_items
from ingress.api.responses.turn import ResponseLog, Turn, check_storable, history_items, response_object
from ingress.context import Context, IngressContext
from ingress.http import json_body
from ingress.http.openapi_contract import STREAMABLE
from ingress.protocol import openapi_body
from ingress.serving.prompts import CHAT
from ingress.serving.request_stream import error_from_event
from ingress.serving.submitter import now_ms
from ingress.tenancy.directory import Caller
from ingress.tenancy.read_limits import Held
from schemas import codec, topics
from schemas.records import StoredResponse

# The longest a lookup waits for this ingress's view of `responses` to read up to the topic's end.
STORE_WAIT_S = 2.0
FINAL = FINAL_STATUSES
CANCEL_WAIT_S = 10.0


def stored_responses(request: Request) -> ResponseFollower:
    return request.app.state.responses


Stored = Annotated[ResponseFollower, Depends(stored_responses)]
router = APIRouter()


def _log(context: IngressContext, stored: ResponseFollower) -> ResponseLog:
    return ResponseLog(context.producer, stored.store)


async def _history(context: IngressContext, stored: ResponseFollower, caller: Caller,
                   body: ResponsesRequest) -> list[list[dict]]:
    """The earlier turns of the conversation this one continues, each as history items."""
    if not body.previous_response_id:
        return []
    await stored.settled(STORE_WAIT_S, context.kafka_reads)
    try:
        turns = await stored.chain(caller.tenant_id, body.previous_response_id, context.kafka_reads)
    except ConversationNotFound as missing:
        raise APIError(404, f"Previous response with id '{missing.response_id}' not found.",
                       code="previous_response_not_found", param="previous_response_id") from None
    return [history_items(t) for t in turns]


def _as_responses_parameter(err: APIError) -> None:
    """A chat completion's parameter name, as the Responses API calls it."""
    if err.param == "messages":
        err.param = "input"
    elif err.param and err.param.startswith("response_format"):
        err.param = "text.format" + err.param.removeprefix("response_format").removeprefix(".json_schema")
    elif err.param and err.param.startswith("tool_choice.function"):
        err.param = "tool_choice" + err.param.removeprefix("tool_choice.function")


@router.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest), responses=STREAMABLE)
async def create_response(request: Request, context: Context, stored: Stored):
    arrived_ms = now_ms()
    caller = context.authenticator.caller(request.headers)
    context.admission.precheck(caller)
    body = await json_body.parse(request, ResponsesRequest)
    unsupported = body.unsupported()
    if unsupported:
        raise APIError(400, f"'{unsupported}' is not supported by this server yet.", code="unsupported_parameter",
                       param=unsupported)
    model = context.submitter.resolve_model(caller, body.model)
    check_storable(caller, body, stored.store, context.settings.default_max_tokens, model.max_model_len)
    history = await _history(context, stored, caller, body)
    # A background stream holds a replay slot for its life: taken before anything is generated, so a
    # tenant past its bound is refused (429) rather than billed for a response it cannot read.
    held = context.read_limits.replays.take(caller.tenant_id) if body.background and body.stream else None
    try:
        try:
            stream = await context.submitter.submit(
                request, caller, body.chat_request(history), CHAT, arrived_ms, id_prefix="resp_",
                background_partition=reply_partition if body.background else None)
        except APIError as err:
            _as_responses_parameter(err)
            raise
        turn = Turn.new(_log(context, stored), caller, body, stream)
        if body.background:
            await turn.save()
            if body.stream:  # the same stream `GET ?stream=true` replays, so it resumes with `starting_after`
                replay = await _replay(request, context, stored, turn.record,
                                       body.timeout or caller.tenant["default_deadline_s"], stream=True, held=held)
                held = None  # the stream's now
                return replay
            return JSONResponse(turn.view_of(), headers={"X-Request-Id": stream.request_id})
    finally:
        if held is not None:
            held.release()
    if body.stream:
        return await stream.sse(ResponseFrames(turn))
    return await turn.whole(stream)


@asynccontextmanager
async def _stored(request: Request, context: IngressContext, stored: ResponseFollower,
                  response_id: str) -> AsyncIterator[tuple[Caller, StoredResponse]]:
    """The caller and its stored response, for the lookup's life: counted as a request against the tenant's
    request rate, and holding one of its lookup slots (read_limits.py), so a tenant looping on lookups is
    refused with a 429 past its quota or its bound instead of taking everyone's reads."""
    caller = context.authenticator.caller(request.headers)
    context.admission.meter(caller)
    with context.read_limits.lookups.take(caller.tenant_id):
        await stored.settled(STORE_WAIT_S, context.kafka_reads)
        record = await stored.record(caller.tenant_id, response_id, context.kafka_reads)
        if record is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found",
                           param="response_id")
        yield caller, record


@router.get("/v1/responses/{response_id}", responses=STREAMABLE)
async def retrieve_response(request: Request, response_id: str, context: Context, stored: Stored,
                            stream: bool = False, starting_after: Annotated[int, Query(ge=-1)] = -1):
    async with _stored(request, context, stored, response_id) as (caller, record):
        if not record["background"]:
            if stream:
                raise APIError(400, "Only background responses can be streamed again.",
                               code="response_not_background", param="stream")
            return response_object(record)
        if record["status"] in ("cancelled", "failed") or (record["status"] in FINAL and not stream):
            return response_object(record)
        return await _replay(request, context, stored, record, caller.tenant["default_deadline_s"], stream,
                             starting_after)


async def _replay(request: Request, context: IngressContext, stored: ResponseFollower, record: StoredResponse,
                  deadline_s: float, stream: bool, starting_after: int = -1, held: Held | None = None):
    """A background response as it stands, or (`stream`) its event stream, read back from Kafka: from its
    start, on whichever process is asked. A stream holds one of its tenant's replay slots (`held`, else
    taken here: a 429 past the bound) until it ends."""
    if stream:  # opened by its first read, inside the stream: the response exists whatever happens there
        held = held or context.read_limits.replays.take(record["tenant_id"])
        replay, _ = replayed_stream(request, record.copy(), stored.store, context.kafka_reads, deadline_s + 60, held)
        turn = Turn(_log(context, stored), record.copy(), replay.view)
        return await replay.sse(ResponseFrames(turn, starting_after), headers_first=True)
    turn, final = await _read_back(request, context, stored, record, deadline_s)
    if final is not None:
        return final
    return turn.view_of("in_progress" if turn.record["output_text"] else "queued")


async def _read_back(request: Request, context: IngressContext, stored: ResponseFollower, record: StoredResponse,
                     deadline_s: float) -> tuple[Turn, dict[str, Any] | None]:
    """A background response as its reply events so far make it: its turn (the text so far filled in) and,
    when those events show it ended, its final Response object. Never written here: the final record is
    the finalizer's (finalizer.py), once its RequestCompleted is seen."""
    replay, source = replayed_stream(request, record.copy(), stored.store, context.kafka_reads, deadline_s + 60)
    turn = Turn(_log(context, stored), record.copy(), replay.view)
    await source.open()
    try:
        for event in await source.read_to_end():
            if event[0] == "error":
                return turn, turn.fail(error_from_event(event[1]))
            replay.view.apply(event[1])
    finally:
        replay.finish(cancelled=False)
    if replay.view.finished:
        return turn, turn.settle()
    turn.record["output_text"] = "".join(replay.view.choices[0].text)
    return turn, None


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str, context: Context, stored: Stored):
    async with _stored(request, context, stored, response_id) as (caller, record):
        if not record["background"]:
            raise APIError(400, "Only background responses can be cancelled.", code="response_not_background",
                           param="response_id")
        if record["status"] in FINAL:
            return response_object(record)
        # Its reply events first: one that already ended is answered as it ended (the finalizer is about to
        # write it so), and never cancelled, which would lose its output.
        turn, final = await _read_back(request, context, stored, record, caller.tenant["default_deadline_s"])
        if final is not None:
            return final
        cancel = codec.new_event("RequestCancelled", request_id=record["request_id"], tenant_id=caller.tenant_id,
                                 reason="client_cancelled")
        await context.producer.send(topics.CANCELLATIONS.name, record["request_id"], "RequestCancelled", cancel)
        # The gate drops it if queued, the worker stops it if running; either writes its RequestCompleted,
        # and the finalizer the final record: `cancelled` with the text generated up to then (billed:
        # docs/billing.md), or, had it ended first, as it ended. OpenAI's spec answers a cancel with the
        # Response (200); one whose end is not written within CANCEL_WAIT_S is answered as it stands.
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            if stored.store.status(caller.tenant_id, response_id) in FINAL:
                found = await stored.record(caller.tenant_id, response_id, context.kafka_reads)
                if found is not None:
                    return response_object(found)
            await asyncio.sleep(0.05)
        return turn.view_of("in_progress" if turn.record["output_text"] else "queued")


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str, context: Context, stored: Stored):
    async with _stored(request, context, stored, response_id) as (caller, _):
        await _log(context, stored).delete(caller.tenant_id, response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str, context: Context, stored: Stored,
                           order: Literal["asc", "desc"] = "desc", limit: Annotated[int, Query(ge=1, le=100)] = 20):
    async with _stored(request, context, stored, response_id) as (_, record):
        base = record["response_id"].removeprefix("resp_")
        items = [{"id": f"msg_{base}_in{i}", **item} for i, item in enumerate(input_items(record))]
    if order == "desc":
        items.reverse()
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
