"""A Responses API turn as the chat completion it runs as, and a stored turn as the next turn's history."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from ingress.api.responses.turn import history_items, output_items
from ingress.api.responses.protocol import ResponsesRequest

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_instructions_history_and_input_become_messages_in_order():
    earlier = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "answer"}]}]
    chat = request(instructions="be brief", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "sec"}, {"type": "input_text", "text": "ond"}]}]).chat_request([earlier])
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "be brief"), ("user", "first"), ("assistant", "answer"), ("user", "second")]


def test_function_calls_and_their_outputs_become_assistant_tool_calls_and_tool_messages():
    body = request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, input=[
        {"type": "message", "role": "user", "content": "weather in Oslo and Rome?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
    ])
    chat = body.chat_request([])
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "assistant", "tool", "tool"]
    assert [c.id for c in chat.messages[1].tool_calls] == ["call_1", "call_2"]
    assert chat.messages[2].tool_call_id == "call_1" and chat.messages[3].text() == "rain"
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice.function.name == "get_weather"


def test_text_format_json_schema_is_chats_response_format():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    chat = request(text={"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}}).chat_request([])
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    assert request(text={"format": {"type": "text"}}).chat_request([]).response_format is None


@pytest.mark.parametrize("bad", [
    {"input": []}, {"input": [{"role": "robot", "content": "x"}]}, {"input": [{"type": "function_call_output"}]},
    {"max_output_tokens": 0}, {"text": {"format": {"type": "yaml"}}}, {"metadata": {"k": 1}},
    {"tools": [{"type": "function", "name": "no spaces allowed"}]},
    {"metadata": {f"k{i}": "v" for i in range(17)}}, {"metadata": {"k" * 65: "v"}}, {"metadata": {"k": "v" * 513}},
])
def test_malformed_bodies_are_refused(bad):
    with pytest.raises(ValidationError):
        request(**bad)


def _record(text: str, calls: list[dict]) -> dict:
    return {"response_id": "resp_abc", "output_text": text, "output_calls_json": json.dumps(calls),
            "input_items_json": json.dumps([{"type": "message", "role": "user",
                                             "content": [{"type": "input_text", "text": "q"}]}])}


def test_an_answer_of_only_calls_has_no_message_item_and_comes_back_as_calls():
    calls = [{"type": "function_call", "call_id": "call_x_0_0", "name": "get_weather", "arguments": "{}"}]
    record = _record("", calls)
    items = output_items(record, "msg_abc", "completed")
    assert [i["type"] for i in items] == ["function_call"] and items[0]["call_id"] == "call_x_0_0"
    assert [i["type"] for i in history_items(record)] == ["message", "function_call"]
    text_only = _record("plain answer", [])
    assert [i["type"] for i in output_items(text_only, "msg_abc", "completed")] == ["message"]
    assert history_items(text_only)[-1]["content"][0]["text"] == "plain answer"
