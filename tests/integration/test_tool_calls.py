"""Tool calling through the whole stack with the openai SDK: calls with ids and arguments that
match their function, finish_reason tool_calls, streamed deltas that add up to the whole answer,
tool results in the history, and bad tool requests refused with a 400 naming the parameter."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.integration.conftest import MODEL_NAME

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER,
                                           "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_a_named_tool_choice_gives_one_valid_call(sdk_client):
    called = 0
    for seed in range(6):
        answer = sdk_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, seed=seed, max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = answer.choices[0]
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert choice.message.content is None
        called += 1
    assert called >= 3  # most answers end by themselves within 80 tokens


def test_streamed_tool_calls_add_up_to_the_whole_answer(sdk_client):
    ended = 0
    for seed in (1, 2, 3):
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=seed,
                      max_tokens=100, parallel_tool_calls=False)
        whole = sdk_client.chat.completions.create(**kwargs).choices[0]
        calls: dict[int, dict] = {}
        finish = None
        for chunk in sdk_client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for piece in choice.delta.tool_calls or []:
                    entry = calls.setdefault(piece.index, {"name": None, "arguments": ""})
                    if piece.function.name:
                        entry["name"] = piece.function.name
                    entry["arguments"] += piece.function.arguments or ""
        assert finish == whole.finish_reason
        expected = [{"name": c.function.name, "arguments": c.function.arguments}
                    for c in whole.message.tool_calls or []]
        assert [calls[i] for i in sorted(calls)] == expected
        if whole.finish_reason == "tool_calls":
            ended += 1
            for c in expected:
                jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    assert ended >= 1


def test_a_tool_result_in_the_history_is_accepted(sdk_client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"}]
    answer = sdk_client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none",
                                            seed=7, max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > 40  # the tools and the call were rendered into the prompt


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "array", "uniqueItems": True}}}}}]}, "tools.0.function.parameters"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400s_naming_the_parameter(stack, extra, param):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, **extra}
    r = httpx.post(f"{stack.base_url}/chat/completions", headers={"Authorization": f"Bearer {stack.api_key}"},
                   json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tool_choice_without_tools_is_a_400(stack):
    r = httpx.post(f"{stack.base_url}/chat/completions", headers={"Authorization": f"Bearer {stack.api_key}"},
                   json={"model": MODEL_NAME, "messages": MESSAGES, "tool_choice": "required"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
