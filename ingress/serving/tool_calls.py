"""Tool calls: the text format a model answers them in, read back into OpenAI's `tool_calls`.

A model calls tools by answering with one or more

    <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>

blocks, exactly that spelling (the grammar in structured_outputs/grammars.py makes it so whenever tools may be
called; the default model's chat template shows calls in the history the same way). With
``tool_choice: "auto"`` an answer is either plain text or starts with its tool calls: text that
only later contains the tag is text.

``ToolCallParser`` reads one choice's text as it streams and gives OpenAI's delta pieces: content,
then for each call a header (index, id, type, name) and its argument fragments. The whole answer
is the same parser fed everything at once, so a streamed answer and a whole one cannot differ.
"""
from __future__ import annotations

import json
import re
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


class ToolCallParser:
    def __init__(self, id_prefix: str):
        self.id_prefix = id_prefix
        self.mode: str | None = None  # "text" or "calls", decided by how the answer starts
        self.pending = ""  # text not yet given out
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self._in_call = False
        self._args_start: int | None = None

    def feed(self, text: str) -> dict[str, Any]:
        """The delta this text adds: {"content": str} and/or {"tool_calls": [...]}, possibly empty."""
        self.pending += text
        return self._drain(final=False)

    def finish(self) -> dict[str, Any]:
        """What is left when the choice ends (an unfinished call keeps what it has)."""
        return self._drain(final=True)

    @property
    def text(self) -> str:
        return "".join(self.content)

    def message_calls(self) -> list[dict[str, Any]]:
        return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.calls]

    # ------------------------------------------------------------------------------------------
    def _arguments_end(self, given: str) -> int | None:
        """Where in ``pending`` the call's arguments end, if they are whole and the call's closing
        ``}</tool_call>`` follows; found by parsing the JSON, so a string inside the arguments that
        spells the closing tag does not end the call."""
        if (self.pending.find("}" + CLOSE)) < 0:
            return None
        text = given + self.pending
        try:
            _, end = _DECODER.raw_decode(text)
        except ValueError:
            return None
        if not text.startswith("}" + CLOSE, end):
            return None
        return end - len(given)

    def _drain(self, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.mode is None:
            if self.pending.startswith(OPEN):
                self.mode = "calls"
            elif not OPEN.startswith(self.pending) or final:
                self.mode = "text"
            else:
                return delta  # too little text yet to tell
        if self.mode == "text":
            self._pending_as_text(delta)
            return delta
        pieces: list[dict[str, Any]] = []
        while True:
            if not self._in_call:
                if self.pending.startswith(OPEN):
                    self.pending = self.pending[len(OPEN):]
                    self._in_call = True
                    self._args_start = None
                elif final and self.pending:  # stray text after the calls: not a call
                    self._pending_as_text(delta)
                    break
                else:
                    break
            if self._args_start is None and not self._call_header(pieces):
                break
            call = self.calls[-1]
            end = self._arguments_end(call["arguments"])
            if end is not None:
                fragment, self.pending = self.pending[:end], self.pending[end + 1 + len(CLOSE):]
                self._in_call = False
            else:
                # keep back what could be the wrapper's closing "}" and the start of the close tag
                keep = 0 if final else len(CLOSE) + 1
                cut = max(0, len(self.pending) - keep)
                fragment, self.pending = self.pending[:cut], self.pending[cut:]
            if fragment:
                call["arguments"] += fragment
                pieces.append({"index": call["index"], "function": {"arguments": fragment}})
            if self._in_call:
                break
        if final:  # cut off before a call's name was whole: left as text
            self._pending_as_text(delta)
        if pieces:
            delta["tool_calls"] = pieces
        return delta

    def _pending_as_text(self, delta: dict[str, Any]) -> None:
        if self.pending:
            self.content.append(self.pending)
            delta["content"] = delta.get("content", "") + self.pending
            self.pending = ""

    def _call_header(self, pieces: list[dict[str, Any]]) -> bool:
        """Start the next call once its header (its name) is whole; whether it was."""
        header = _HEADER.match(self.pending)
        if header is None:
            return False
        call = {"index": len(self.calls), "id": f"{self.id_prefix}_{len(self.calls)}",
                "name": json.loads(header.group(1)), "arguments": ""}
        self.calls.append(call)
        self.pending = self.pending[header.end():]
        self._args_start = 0
        pieces.append({"index": call["index"], "id": call["id"], "type": "function",
                       "function": {"name": call["name"], "arguments": ""}})
        return True


def tool_spec(body) -> dict[str, Any] | None:
    """The grammar spec (structured_outputs/grammars.py) that makes the answer's tool calls well-formed and their
    arguments match their schemas; None where no tool may be called. Raises APIError for tools or a
    tool_choice that cannot be honoured."""
    from http_api.openai_errors import APIError

    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools.", param="tool_choice", code="invalid_value")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "Tool names must be unique.", param="tools", code="duplicate_tool_name")
    if choice == "none":
        return None
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "response_format cannot be combined with tools that may be called; use "
                            "tool_choice 'none' or drop one of them.", param="response_format",
                       code="unsupported_parameter")
    chosen = list(enumerate(tools))
    if not isinstance(choice, str) and choice is not None:
        chosen = [(i, t) for i, t in enumerate(tools) if t.function.name == choice.function.name]
        if not chosen:
            raise APIError(400, f"tool_choice names the function '{choice.function.name}', which is not in tools.",
                           param="tool_choice.function.name", code="unknown_tool")
    mode = "auto" if choice in (None, "auto") else "required"
    named = not isinstance(choice, str) and choice is not None  # a named function is called exactly once
    return {"type": "tool_calls", "mode": mode, "parallel": bool(body.parallel_tool_calls) and not named,
            "tools": [{"name": t.function.name, "index": i, "parameters": t.function.parameters or {"type": "object"}}
                      for i, t in chosen]}
