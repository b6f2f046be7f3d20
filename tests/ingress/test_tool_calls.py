"""Reading tool calls out of an answer: streamed in any pieces it gives what the whole gives."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ingress.serving.tool_calls import ToolCallParser


def call(name: str, args: dict) -> str:
    return '<tool_call>{"name": ' + json.dumps(name) + ', "arguments": ' + json.dumps(args) + "}</tool_call>"


def whole(text: str) -> ToolCallParser:
    p = ToolCallParser("call_x")
    p.feed(text)
    p.finish()
    return p


def streamed(text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Content and calls rebuilt from the deltas alone, as an OpenAI client does."""
    p = ToolCallParser("call_x")
    content, calls = "", []
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    deltas = [p.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.finish()]
    for d in deltas:
        content += d.get("content", "")
        for piece in d.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] == len(calls)
                calls.append({"id": piece["id"], "type": "function",
                              "function": {"name": piece["function"]["name"], "arguments": ""}})
            calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return content, calls


def test_calls_are_read_with_names_ids_and_arguments():
    text = call("get_weather", {"city": "Oslo", "days": 2}) + call("add", {"a": 1, "b": [2, "}</tool_call>"]})
    p = whole(text)
    assert p.text == ""
    assert p.message_calls() == [
        {"id": "call_x_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}},
        {"id": "call_x_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": [2, "}</tool_call>"]}'}}]
    assert json.loads(p.calls[1]["arguments"]) == {"a": 1, "b": [2, "}</tool_call>"]}


def test_text_that_does_not_start_with_a_call_is_text():
    for text in ("Hello <tool_call>", "<tool", "", "<toolbox>" + call("f", {})):
        p = whole(text)
        assert p.text == text and p.calls == []


def test_an_answer_cut_inside_a_call_keeps_what_it_has():
    text = call("f", {"x": "abcdef"})[:-20]
    p = whole(text)
    assert p.calls[0]["name"] == "f" and p.calls[0]["arguments"] == text.split('"arguments": ', 1)[1]


ARGS = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6) | st.just("}</tool_call>"),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(names=st.lists(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), min_size=0, max_size=3),
       args=st.lists(st.dictionaries(st.text(max_size=5), ARGS, max_size=3), min_size=3, max_size=3),
       prose=st.text(max_size=20), cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_split_of_the_stream_gives_the_whole_answer(names, args, prose, cuts):
    text = "".join(call(n, a) for n, a in zip(names, args)) if names else prose
    content, calls = streamed(text, cuts)
    p = whole(text)
    assert content == p.text
    assert calls == p.message_calls()
    if names:
        assert [c["function"]["name"] for c in calls] == names
        assert [json.loads(c["function"]["arguments"]) for c in calls] == args[:len(names)]
