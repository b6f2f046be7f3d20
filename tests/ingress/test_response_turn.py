"""A Response settles from how its request ended: a background one was stored `queued`, so its end is what
makes it completed or incomplete (it stayed `queued` when it ended on a stop, and a cancel then answered
`queued`)."""
from __future__ import annotations

import json

import pytest

from ingress.api.responses.protocol import ResponsesRequest
from ingress.api.responses.store import record_bytes
from ingress.api.responses.turn import Turn, new_record
from ingress.serving.request_view import ChatView
from ingress.tenancy.directory import Caller
from schemas import codec


def _background_record():
    return {"response_id": "resp_1", "request_id": "req-1", "created_at": 1_700_000_000, "status": "queued",
            "background": True, "error_message": None, "incomplete_reason": None, "instructions": None,
            "max_output_tokens": 10, "model": "tiny", "previous_response_id": None, "temperature": None,
            "top_p": None, "text_json": json.dumps({"format": {"type": "text"}}),
            "tool_choice_json": json.dumps("auto"), "tools_json": "[]", "user": None, "metadata_json": "{}",
            "input_tokens": 4, "output_tokens": 0, "cached_tokens": 0, "output_text": "",
            "output_calls_json": "[]"}


@pytest.mark.parametrize("finish,status", [("stop", "completed"), ("length", "incomplete")])
def test_a_finished_background_response_is_no_longer_queued(finish, status):
    view = ChatView(response_id="resp_1", model="tiny", n=1, prompt_tokens=4)
    view.apply({"choice_index": 0, "first_token_index": 0, "token_ids": [7, 8], "text": "ab",
                "finish_reason": finish, "logprobs": None, "usage": {"completion_tokens": 2, "cached_tokens": 0}})
    turn = Turn(log=None, record=_background_record(), view=view)
    body = turn.settle()
    assert body["status"] == status == turn.record["status"]
    assert body["output"][0]["content"][0]["text"] == "ab"
    assert body["usage"]["output_tokens"] == 2


def test_a_new_record_is_the_record_the_topic_gives_back():
    """Read-your-writes applies the record as created; the follower, the one it reads back: the two weigh the same
    against the tenant's caps only if the created record already has every field the schema fills in."""
    body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi", "tool_choice": "none"})
    record = new_record(Caller(tenant={"tenant_id": "acme"}, key_id="k"), body, "req-1", "resp_1", 4, -1, 0)
    read_back = codec.decode(*codec.encode("StoredResponse", dict(record)), check=True).record
    assert read_back == record
    assert record_bytes(read_back) == record_bytes(record)
