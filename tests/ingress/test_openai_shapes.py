"""The bodies ingress builds, checked offline against OpenAI's own API description (tests/integration/openai_spec.py)
in every state, including those the live suite (tests/integration/test_openai_spec_conformance.py) reaches slowly
or not at all: each batch status, a failed, queued or cancelled response, a choice with logprobs or tool calls.
A key the spec requires is present (null only where it allows null); a key it types without null is left out."""
from __future__ import annotations

import json

import pytest

from ingress.api.batches.routes import batch_object
from ingress.api.responses.turn import response_error, response_object
from ingress.serving.request_view import ChatView, TextView
from tests.integration.openai_spec import openai_spec

COUNTS = {"total": 3, "completed": 1, "failed": 1, "cancelled": 1, "expired": 0}


@pytest.fixture(scope="module")
def spec():
    return openai_spec()


def _manifest(**extra):
    return {"batch_id": "batch_1", "endpoint": "/v1/chat/completions", "input_file_id": "file-1",
            "completion_window": "24h", "created_at_ms": 1_700_000_000_000, "deadline_ms": 1_700_086_400_000,
            "published_at_ms": 1_700_000_001_000, **extra}


FINAL = {"at_ms": 1_700_000_100_000, "output_file_id": "file-out", "error_file_id": "file-err"}


@pytest.mark.parametrize("status,manifest", [
    ("validating", _manifest(published_at_ms=None)),
    ("in_progress", _manifest(metadata={"job": "x"})),
    ("cancelling", _manifest(cancel_requested_at_ms=1_700_000_050_000)),
    ("completed", _manifest(final=FINAL)),
    ("failed", _manifest(final={"at_ms": 1_700_000_002_000, "error_file_id": "file-err"})),
    ("cancelled", _manifest(cancel_requested_at_ms=1_700_000_050_000, final=FINAL)),
    ("expired", _manifest(final=FINAL)),
])
def test_every_batch_status_is_an_openai_batch(spec, status, manifest):
    body = batch_object(manifest, status, COUNTS)
    assert spec.violations(body, spec.operation_schema("GET", "/batches/{batch_id}", 200)) == []
    assert None not in body.values()  # what has no value yet is left out
    assert body["status"] == status
    assert ("completed_at" in body) == (status == "completed")
    assert ("cancelling_at" in body) == ("cancel_requested_at_ms" in manifest)
    assert ("errors" in body) == (status == "failed")


def _record(**extra):
    return {"response_id": "resp_1", "created_at": 1_700_000_000, "status": "completed", "background": False,
            "error_message": None, "incomplete_reason": None, "instructions": None, "max_output_tokens": None,
            "model": "tiny", "previous_response_id": None, "temperature": None, "top_p": None,
            "text_json": json.dumps({"format": {"type": "text"}}), "tool_choice_json": json.dumps("auto"),
            "tools_json": "[]", "user": None, "metadata_json": "{}", "input_tokens": 5, "output_tokens": 3,
            "cached_tokens": 2, "output_text": "hi", "output_calls_json": "[]", **extra}


@pytest.mark.parametrize("record", [
    _record(),
    _record(status="incomplete", incomplete_reason="max_output_tokens", user="u-1"),
    _record(status="queued", background=True, output_text=""),
    _record(status="in_progress", background=True, output_text="partial"),
    _record(status="cancelled", background=True),
    _record(status="failed", error_message="deadline_exceeded: The request did not finish in time."),
    _record(output_text="", output_calls_json=json.dumps(
        [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}])),
], ids=["completed", "incomplete", "queued", "in_progress", "cancelled", "failed", "function_call"])
def test_every_response_state_is_an_openai_response(spec, record):
    body = response_object(record, user=record["user"])  # the request's user (a stored record has none)
    assert spec.violations(body, spec.operation_schema("GET", "/responses/{response_id}", 200)) == []
    assert ("usage" in body) == (record["status"] in ("completed", "incomplete"))
    assert ("user" in body) == (record["user"] is not None)


def test_a_response_error_code_is_one_of_openais():
    assert response_error("rate_limit_tokens: slow down") == {"code": "rate_limit_exceeded",
                                                               "message": "rate_limit_tokens: slow down"}
    assert response_error("deadline_exceeded: late")["code"] == "server_error"


def _item(index, tokens, text, finish=None, logprobs=None):
    return {"choice_index": index, "first_token_index": 0, "token_ids": tokens, "text": text,
            "finish_reason": finish, "logprobs": logprobs,
            "usage": {"completion_tokens": len(tokens), "cached_tokens": 0} if finish else None}


@pytest.mark.parametrize("logprobs", [None, [-0.5, -1.25]])
def test_chat_and_text_answers_are_openai_completions(spec, logprobs):
    chat = ChatView(response_id="chatcmpl-1", model="tiny", n=2, prompt_tokens=4)
    text = TextView(response_id="cmpl-1", model="tiny", n=2, prompt_tokens=4)
    for view in (chat, text):
        for index in (0, 1):
            view.apply(_item(index, [7, 8], "ab", "length", logprobs))
    body = chat.body()
    assert spec.violations(body, spec.operation_schema("POST", "/chat/completions", 200)) == []
    assert [c["message"]["refusal"] for c in body["choices"]] == [None, None]  # required, and null
    assert spec.violations(text.body(), spec.operation_schema("POST", "/completions", 200)) == []


def test_a_tool_call_answer_is_an_openai_completion(spec):
    chat = ChatView(response_id="chatcmpl-1", model="tiny", n=1, prompt_tokens=4, tool_call_prefix="call_abc")
    chat.apply(_item(0, [1, 2, 3], '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "stop"))
    body = chat.body()
    assert spec.violations(body, spec.operation_schema("POST", "/chat/completions", 200)) == []
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'} and body["choices"][0]["message"]["content"] is None
