"""Structured outputs through the whole stack, as the openai SDK uses them: answers parse into the
caller's model every time they end by themselves, streamed equals whole, and a bad schema is a 400
naming the parameter before anything is queued."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import MODEL_NAME

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


class Ticket(BaseModel):
    title: str = Field(max_length=8)
    severity: Literal["low", "high", "critical"]
    estimate_hours: int = Field(ge=0, le=99)
    labels: list[Literal["bug", "ui", "db"]] = Field(max_length=2)


MESSAGES = [{"role": "user", "content": "File a ticket for the broken login page."}]


def test_parse_with_a_pydantic_model_gives_a_valid_object_for_every_seed(sdk_client):
    parsed = 0
    for seed in range(12):
        try:
            answer = sdk_client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, response_format=Ticket,
                                                   seed=seed, max_tokens=120, temperature=1.0)
        except openai.LengthFinishReasonError:
            continue  # cut by max_tokens: the SDK tells the caller instead of handing back broken JSON
        message = answer.choices[0].message
        assert isinstance(message.parsed, Ticket)
        assert answer.choices[0].finish_reason == "stop"
        parsed += 1
    assert parsed >= 10


def test_streamed_answer_equals_the_whole_one(sdk_client):
    schema = Ticket.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": schema, "strict": True}}
    for seed in (3, 4, 5):
        whole = sdk_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=fmt, seed=seed,
                                               max_tokens=120)
        parts = sdk_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=fmt, seed=seed,
                                               max_tokens=120, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        assert streamed == whole.choices[0].message.content
        if whole.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(streamed), schema)


def test_json_object_mode(sdk_client):
    for seed in range(4):
        answer = sdk_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=seed, max_tokens=150,
                                                response_format={"type": "json_object"})
        if answer.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("response_format, param, says", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}},
     "response_format.json_schema.schema", "strng"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
     "response_format.json_schema.schema", "#/uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema", "schema"),
    ({"type": "json_schema", "json_schema": {"name": "not a name!", "schema": {}}}, "response_format.json_schema.name",
     "name"),
    ({"type": "yaml"}, "response_format.type", "type"),
    ({"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "properties": {f"field_{i:05d}": {"type": "string", "maxLength": 100} for i in range(2000)}}}},
     "response_format.json_schema.schema", "limit"),
])
def test_a_bad_response_format_is_a_400_naming_the_parameter(stack, response_format, param, says):
    r = httpx.post(f"{stack.base_url}/chat/completions", headers={"Authorization": f"Bearer {stack.api_key}"},
                   json={"model": MODEL_NAME, "messages": MESSAGES, "response_format": response_format}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"] and error["type"] == "invalid_request_error"
