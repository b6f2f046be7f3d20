"""Turns reply events into OpenAI response bodies and SSE chunks."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ingress.serving.tool_calls import ToolCallParser
from schemas.records import ReplyItem


@dataclass
class ChoiceState:
    """One choice of a request, de-duplicated by token index (exactly-once to the client)."""
    next_index: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0

    def accept(self, item: ReplyItem) -> str | None:
        """The text this item adds for the client, or None if it was already delivered."""
        if self.finish_reason is not None:
            return None
        tokens = item["token_ids"]
        first = item["first_token_index"]
        if tokens and first + len(tokens) <= self.next_index:
            return None  # a replay after failover: the client already has these
        if not tokens and first < self.next_index:
            return None
        skip = max(0, self.next_index - first)
        fresh = tokens[skip:]
        self.token_ids.extend(fresh)
        logprobs = item.get("logprobs")
        if logprobs:
            self.logprobs.extend(logprobs[skip:])
        self.next_index = first + len(tokens)
        text = item["text"]
        self.text.append(text)
        finish_reason = item.get("finish_reason")
        if finish_reason:
            self.finish_reason = finish_reason
            usage = item.get("usage")
            self.completion_tokens = usage["completion_tokens"] if usage else self.next_index
        return text


@dataclass
class RequestView:
    """What ingress knows of one in-flight request while it streams; how it is written out is the
    answer's shape (`ChatView`, `TextView`)."""
    response_id: str
    model: str
    n: int
    prompt_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[ChoiceState] = field(default_factory=list)
    cached_tokens: int = 0
    role_sent: set[int] = field(default_factory=set)
    # set when the answer may call tools: its text is read as tool calls (ingress/serving/tool_calls.py)
    tool_call_prefix: str | None = None
    parsers: dict[int, ToolCallParser] = field(default_factory=dict)

    OBJECT: ClassVar[str]
    CHUNK_OBJECT: ClassVar[str]

    def __post_init__(self):
        self.choices = [ChoiceState() for _ in range(self.n)]

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> dict[str, Any]:
        completion = sum(c.completion_tokens or c.next_index for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def apply(self, item: ReplyItem) -> tuple[int, str, str | None] | None:
        index = item["choice_index"]
        if not 0 <= index < self.n:
            return None
        choice = self.choices[index]
        text = choice.accept(item)
        if text is None:
            return None
        usage = item.get("usage")
        if usage:
            self.cached_tokens = max(self.cached_tokens, usage.get("cached_tokens", 0))
        return index, text, choice.finish_reason

    # --- streaming ---
    def chunk(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"id": self.response_id, "object": self.CHUNK_OBJECT, "created": self.created,
                "model": self.model, "choices": [self.chunk_choice(index, text, finish_reason)]}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": self.CHUNK_OBJECT, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}

    # --- whole response ---
    def body(self) -> dict[str, Any]:
        choices = [self.whole_choice(i, c) for i, c in enumerate(self.choices)]
        return {"id": self.response_id, "object": self.OBJECT, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def whole_choice(self, index: int, choice: ChoiceState) -> dict[str, Any]:
        raise NotImplementedError


class TextView(RequestView):
    """A text completion's answer (`text_completion`, chunks alike)."""
    OBJECT = CHUNK_OBJECT = "text_completion"

    def chunk_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def whole_choice(self, index: int, choice: ChoiceState) -> dict[str, Any]:
        logprobs = ({"tokens": [f"token_id:{t}" for t in choice.token_ids], "token_logprobs": choice.logprobs}
                    if choice.logprobs else None)
        return {"index": index, "text": "".join(choice.text), "logprobs": logprobs,
                "finish_reason": choice.finish_reason}


class ChatView(RequestView):
    """A chat completion's answer: an assistant message per choice, its text read as tool calls where the
    request may call tools."""
    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"

    def _parser(self, index: int) -> ToolCallParser:
        return ToolCallParser(f"{self.tool_call_prefix}_{index}")

    @staticmethod
    def _finish_reason(parser: ToolCallParser | None, reason: str | None) -> str | None:
        return "tool_calls" if parser is not None and parser.calls and reason == "stop" else reason

    def chunk_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text}
        if self.tool_call_prefix is not None:
            parser = self.parsers.setdefault(index, self._parser(index))
            delta = parser.feed(text)
            if finish_reason is not None:
                for key, value in parser.finish().items():
                    delta[key] = delta.get(key, "" if key == "content" else []) + value
            finish_reason = self._finish_reason(parser, finish_reason)
        if index not in self.role_sent:
            self.role_sent.add(index)
            delta["role"] = "assistant"
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def whole_choice(self, index: int, choice: ChoiceState) -> dict[str, Any]:
        text = "".join(choice.text)
        logprobs: dict[str, Any] | None = None
        if choice.logprobs:
            logprobs = {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                    for t, lp in zip(choice.token_ids, choice.logprobs)], "refusal": None}
        # `refusal` is required in OpenAI's schema (null: this server never refuses)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        finish_reason = choice.finish_reason
        if self.tool_call_prefix is not None:
            parser = self._parser(index)  # the streamed answer's parser, fed all at once
            parser.feed(text)
            parser.finish()
            if parser.calls:
                message = {"role": "assistant", "content": parser.text or None, "refusal": None,
                           "tool_calls": parser.message_calls()}
            finish_reason = self._finish_reason(parser, finish_reason)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
