"""The body of `POST /v1/responses` (OpenAI's Responses API), validated strictly, and how a turn becomes chat
messages: the request's `instructions` as the system message, then every earlier turn of the conversation
(its input items and its answer), then this turn's input.

Not accepted yet, each refused with a 400 naming the parameter: `tools`, `text.format` other than plain text,
and input item types other than messages; `background` without `store`, or with `stream` (create it, then
stream it with `GET /v1/responses/{id}?stream=true`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ingress.protocol import ChatCompletionRequest

MAX_METADATA_KEYS = 16


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["input_text", "output_text"]
    text: StrictStr


class InputMessage(BaseModel):
    """An input item: a message with text content (a string or text parts)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | Annotated[list[ContentPart], Field(min_length=1)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def normalized(self) -> dict[str, Any]:
        """The stored form (and the one `input_items` lists): content always as parts."""
        kind = "output_text" if self.role == "assistant" else "input_text"
        parts = ([{"type": kind, "text": self.content}] if isinstance(self.content, str)
                 else [{"type": p.type, "text": p.text} for p in self.content])
        return {"type": "message", "role": self.role, "content": parts}


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]


class TextOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: StrictStr
    input: StrictStr | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    metadata: Annotated[dict[StrictStr, Annotated[StrictStr, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA_KEYS)] | None = None
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    stream: StrictBool = False
    user: StrictStr | None = None
    text: TextOptions | None = None
    background: StrictBool = False
    # refused for now (see the module docstring); typed loosely so the 400 names it
    tools: list | None = None
    # extensions, as on the other endpoints
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)] | None = None
    priority: Literal["interactive", "batch"] = "interactive"
    timeout: Annotated[float, Field(gt=0, le=3600)] | None = None

    def unsupported(self) -> str | None:
        """The first parameter this server does not serve (yet, or in this combination), if any."""
        if self.background and (not self.store or self.stream):
            return "store" if not self.store else "stream"
        if self.tools:
            return "tools"
        return None

    def input_messages(self) -> list[InputMessage]:
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)

    def chat_request(self, history: list[tuple[list[dict[str, Any]], str]]) -> ChatCompletionRequest:
        """This turn as a chat completion request. `history`: each earlier turn's input items (stored form)
        and answer, oldest first."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for items, answer in history:
            for item in items:
                messages.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
            messages.append({"role": "assistant", "content": answer})
        messages += [{"role": m.role, "content": m.text()} for m in self.input_messages()]
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "user": self.user,
            "priority": self.priority, "timeout": self.timeout,
        })
