"""A Responses API response as it is stored (one `StoredResponse` record on the compacted `responses`
topic) and as it is answered (the Response object and its output items), and `Turn`, one response being
answered: filled in from its reply events, then written out."""
from __future__ import annotations

import json
import time
from typing import Any

from fastapi.responses import JSONResponse, Response

from http_api.openai_errors import APIError
from ingress.api.responses.protocol import FunctionToolChoice, ResponsesRequest
from ingress.api.responses.store import (ResponseStore, input_items, record_bytes, stored_bytes_per_tenant,
                                         stored_responses_per_tenant)
from ingress.kafka.producer import AsyncProducer
from ingress.serving.request_stream import RequestStream
from ingress.serving.request_view import RequestView
from ingress.serving.tool_calls import ToolCallParser
from ingress.tenancy.directory import Caller
from schemas import codec, topics
from schemas.records import StoredResponse
from infra import settings


def _usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    # no cache is written ahead of time here (`cache_write_tokens`, required by OpenAI's schema): always 0
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def output_items(record: StoredResponse, item_id: str, status: str) -> list[dict[str, Any]]:
    """The answer's output items: its message (left out when the answer is only function calls), then its
    function calls."""
    calls = json.loads(record["output_calls_json"])
    items = [] if calls and not record["output_text"] else [message_item(item_id, record["output_text"], status)]
    return items + [{"id": "fc_" + c["call_id"].removeprefix("call_"), "status": "completed", **c} for c in calls]


def history_items(record: StoredResponse) -> list[dict[str, Any]]:
    """One stored turn as a later turn's history: its input items, then its answer, in stored form."""
    answer: list[dict[str, Any]] = [{"type": "message", "role": "assistant",
                                     "content": [{"type": "output_text", "text": record["output_text"]}]}]
    calls = json.loads(record["output_calls_json"])
    if calls and not record["output_text"]:
        answer = []
    return input_items(record) + answer + calls


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


# OpenAI's `ResponseError.code` is a closed list: a limit's refusal is its `rate_limit_exceeded`, anything else
# its `server_error`; tokenmill's own code stays at the head of the message ("deadline_exceeded: ...").
RATE_LIMIT_CODES = frozenset({"rate_limit_requests", "rate_limit_tokens", "concurrency_limit",
                              "monthly_budget_exceeded", "queue_full"})


def response_error(message: str) -> dict[str, str]:
    code = message.split(":", 1)[0]
    return {"code": "rate_limit_exceeded" if code in RATE_LIMIT_CODES else "server_error", "message": message}


def response_object(record: StoredResponse, status: str | None = None, output: list | None = None,
                    store: bool = True, user: str | None = None) -> dict[str, Any]:
    """The Response object of a stored (or about to be stored) response record; `store` and `user` are the
    request's (a record is stored, and holds no user)."""
    status = status or record["status"]
    item_id = "msg_" + record["response_id"].removeprefix("resp_")
    done = status in ("completed", "incomplete")
    if output is None and not done:
        output = [] if not record["output_text"] else [message_item(item_id, record["output_text"], "incomplete")]
    if output is None:
        output = output_items(record, item_id, "completed" if status == "completed" else "incomplete")
    obj: dict[str, Any] = {
        "id": record["response_id"], "object": "response", "created_at": record["created_at"], "status": status,
        "background": record["background"],
        "error": (response_error(record["error_message"])
                  if record["status"] == "failed" and record["error_message"] else None),
        "incomplete_details": {"reason": record["incomplete_reason"]} if status == "incomplete" else None,
        "instructions": record["instructions"], "max_output_tokens": record["max_output_tokens"],
        "model": record["model"], "output": output, "parallel_tool_calls": True,
        "previous_response_id": record["previous_response_id"], "store": store,
        "temperature": record["temperature"], "top_p": record["top_p"], "text": json.loads(record["text_json"]),
        "tool_choice": json.loads(record["tool_choice_json"]), "tools": json.loads(record["tools_json"]),
        "truncation": "disabled",
        "metadata": json.loads(record["metadata_json"]),
    }
    if done:
        obj["usage"] = _usage(record["input_tokens"], record["output_tokens"], record["cached_tokens"])
    # OpenAI's schema types it without null: left out unless there is one
    if user is not None:
        obj["user"] = user
    return obj


def new_record(caller: Caller, body: ResponsesRequest, request_id: str, response_id: str, prompt_tokens: int,
               reply_partition: int, created_at_ms: int) -> StoredResponse:
    """The `StoredResponse` record of a response as it is created (its answer not yet in it)."""
    envelope = codec.new_event("StoredResponse", request_id=request_id)
    choice = body.tool_choice
    return {
        "event_id": envelope["event_id"], "request_id": request_id, "schema_version": envelope["schema_version"],
        "timestamp_ms": envelope["timestamp_ms"], "response_id": response_id, "tenant_id": caller.tenant_id,
        "deleted": False, "model": body.model, "created_at": int(time.time()),
        "status": "queued" if body.background else "completed", "incomplete_reason": None,
        "previous_response_id": body.previous_response_id, "instructions": body.instructions,
        "input_items_json": json.dumps(body.input_items()),
        "tools_json": json.dumps([t.model_dump(exclude_none=True) for t in body.tools or []]),
        "tool_choice_json": json.dumps(choice.model_dump() if isinstance(choice, FunctionToolChoice)
                                       else choice or "auto"),
        "output_text": "", "output_calls_json": "[]", "metadata_json": json.dumps(body.metadata or {}),
        "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "input_tokens": prompt_tokens, "output_tokens": 0, "cached_tokens": 0, "background": body.background,
        "reply_partition": reply_partition, "created_at_ms": created_at_ms, "error_message": None,
        "text_json": json.dumps(body.text.echo() if body.text else {"format": {"type": "text"}}),
    }


# What an answer's token may add to its stored record at most, counted before generating it (a token's text,
# and its function-call arguments, escaped): the allowance the size checks below make for the answer.
OUTPUT_BYTES_PER_TOKEN = 32


def max_stored_response_bytes() -> int:
    """The largest stored record allowed: below what one Kafka message may carry (librdkafka's
    message.max.bytes, 1,000,000, and the broker's 1 MiB), with room for headers and framing."""
    return settings.MAX_STORED_RESPONSE_BYTES.get()


def check_storable(caller: Caller, body: ResponsesRequest, store: ResponseStore, default_max_tokens: int,
                   max_model_len: int | None = None) -> None:
    """Before anything is generated or billed: refuse a response whose record could not be stored (400
    `response_too_large`: too big for one Kafka message once its answer is in it), or one past the tenant's
    caps on stored responses (429 `stored_responses_limit`; deleting or expiry frees room). Before, such a
    record failed after generation: billed, then a 500."""
    if not body.store:
        return
    draft = new_record(caller, body, "0" * 32, "resp_" + "0" * 32, 0, -1, 0)
    tokens = body.max_output_tokens or default_max_tokens
    if max_model_len is not None:  # the model stops there whatever max_output_tokens says
        tokens = min(tokens, max_model_len)
    answer = tokens * OUTPUT_BYTES_PER_TOKEN
    encoded = len(codec.encode("StoredResponse", dict(draft))[0]) + answer
    limit = max_stored_response_bytes()
    if encoded > limit:
        raise APIError(400, f"This response could not be stored: its input, instructions, tools, text format and "
                            f"metadata with room for {tokens} output tokens "
                            f"take about {encoded} bytes, over the {limit} a stored response may have. Send less, "
                            "lower max_output_tokens, or use store: false.", code="response_too_large",
                       param="input")
    count, size = store.usage(caller.tenant_id)
    max_count, max_bytes = stored_responses_per_tenant(), stored_bytes_per_tenant()
    if count >= max_count or size + record_bytes(draft) + answer > max_bytes:
        raise APIError(429, f"This API key's organisation stores {count} responses ({size} bytes), its most "
                            f"({max_count} responses, {max_bytes} bytes); delete some or wait for them to expire, "
                            "or use store: false.", code="stored_responses_limit")


class ResponseLog:
    """Where stored responses are written: the compacted `responses` topic, and this process's view of it
    (read-your-writes, before the follower reads the record back)."""

    def __init__(self, producer: AsyncProducer, store: ResponseStore):
        self.producer, self.store = producer, store

    async def save(self, record: StoredResponse) -> None:
        await self.producer.send(topics.RESPONSES.name, record["response_id"], "StoredResponse", dict(record))
        self.store.apply(record)

    async def delete(self, tenant_id: str, response_id: str) -> None:
        tombstone = codec.new_event("StoredResponse", response_id=response_id, tenant_id=tenant_id, deleted=True)
        await self.producer.send(topics.RESPONSES.name, response_id, "StoredResponse", tombstone)
        self.store.apply(codec.record_of(codec.decode(*codec.encode("StoredResponse", tombstone)), StoredResponse))


class Turn:
    """One response: its record, filled in from its answer's view as the answer streams, and how it is
    written out. A new turn (`Turn.new`), a background one read back from Kafka (`Turn(log, stored record,
    the replayed stream's view)`), or one only settled, never written here (`log` None: the finalizer's)."""

    def __init__(self, log: ResponseLog | None, record: StoredResponse, view: RequestView, store: bool = True,
                 user: str | None = None) -> None:
        self.log, self.record, self.view = log, record, view
        self.store, self.user = store, user
        self.item_id = "msg_" + record["response_id"].removeprefix("resp_")
        self.sequence = 0
        # the answer may call tools: its text is read as calls at the end (ingress/serving/tool_calls.py)
        self.calls_tools = json.loads(record["tools_json"]) != [] and json.loads(record["tool_choice_json"]) != "none"

    @classmethod
    def new(cls, log: ResponseLog, caller: Caller, body: ResponsesRequest, stream: RequestStream) -> "Turn":
        record = new_record(caller, body, stream.request_id, stream.view.response_id, stream.view.prompt_tokens,
                            stream.record["reply_partition"] if body.background else -1,
                            stream.record["arrived_at_ms"])
        return cls(log, record, stream.view, body.store, body.user)

    def settle(self) -> dict[str, Any]:
        """Fill in the answer once the request finished; the Response object."""
        view = self.view
        choice = view.choices[0]
        usage = view.usage()
        text, calls = "".join(choice.text), []
        if self.calls_tools:
            parser = ToolCallParser("call_" + (self.record["request_id"] or "")[:16] + "_0")
            parser.feed(text)
            parser.finish()
            text = parser.text
            calls = [{"type": "function_call", "call_id": c["id"], "name": c["name"], "arguments": c["arguments"]}
                     for c in parser.calls]
        self.record.update({"output_text": text, "output_calls_json": json.dumps(calls),
                            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                            "cached_tokens": view.cached_tokens})
        # a background record was stored `queued`: its end is what makes it completed (or incomplete)
        if choice.finish_reason == "length":
            self.record.update({"status": "incomplete", "incomplete_reason": "max_output_tokens"})
        else:
            self.record.update({"status": "completed", "incomplete_reason": None})
        return self.view_of()

    def view_of(self, status: str | None = None, output: list | None = None) -> dict[str, Any]:
        return response_object(self.record, status, output, self.store, self.user)

    def fail(self, err: APIError) -> dict[str, Any]:
        self.record.update({"status": "failed", "error_message": f"{err.code or err.error_type}: {err.message}"})
        return self.view_of()

    async def save(self) -> None:
        if not self.store:
            return
        assert self.log is not None, "a turn without a log is settled only, never written"
        await self.log.save(self.record)

    async def whole(self, stream: RequestStream) -> Response:
        """Collect the answer from `stream` (this turn's), store it, answer it whole."""
        failed = await stream.collect()
        if failed is not None:
            return failed
        obj = self.settle()
        await self.save()
        return JSONResponse(obj, headers=stream.headers)
