"""The body of `POST /v1/responses` (OpenAI's Responses API), validated strictly, and how a turn becomes chat
messages: the request's `instructions` as the system message, then every earlier turn of the conversation
(its input items and its answer), then this turn's input.

`text.format` (`text`, `json_object`, `json_schema` with `strict`) constrains the answer as chat's
`response_format` does, and function `tools` (with `tool_choice`, `parallel_tool_calls`) are called as on
chat completions (docs/structured_outputs.md): the answer's calls are `function_call` output items, and a
later turn sends their results as `function_call_output` input items. Refused with a 400 naming the
parameter: `background` without `store` (as OpenAI's API; the schema says so with a `not`); other tool and
item types (built-in tools, images, files)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from pydantic.config import JsonDict

from ingress.http.metadata_limits import MAX_METADATA_KEY_CHARS, MAX_METADATA_PAIRS, MAX_METADATA_VALUE_CHARS
from ingress.protocol import TOOL_NAME, ChatCompletionRequest, FunctionDefinition, tool_rules



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


class FunctionCallItem(BaseModel):
    """An input item: a function call the model made in an earlier turn (as its output listed it)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function_call"]
    call_id: StrictStr
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME)]
    arguments: StrictStr

    def normalized(self) -> dict[str, Any]:
        return {"type": "function_call", "call_id": self.call_id, "name": self.name, "arguments": self.arguments}


class FunctionCallOutputItem(BaseModel):
    """An input item: the caller's result of a function call."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr

    def normalized(self) -> dict[str, Any]:
        return {"type": "function_call_output", "call_id": self.call_id, "output": self.output}


class FunctionTool(FunctionDefinition):
    """A function tool, in the Responses API's flat form: chat's function definition with its type beside it."""
    type: Literal["function"]


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    name: StrictStr


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored-form items (messages, function calls and their outputs) as chat messages: consecutive calls
    become one assistant message with several tool calls, an output a `tool` message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            messages.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
    return messages


class PlainTextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["json_object"]


class JsonSchemaTextFormat(BaseModel):
    """`text.format` of type json_schema: the Responses API's flat form of chat's `response_format`."""
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    schema_: dict = Field(alias="schema")
    strict: StrictBool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    format: Annotated[PlainTextFormat | JsonObjectFormat | JsonSchemaTextFormat, Field(discriminator="type")] | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat completion `response_format` this asks for (None: free text)."""
        fmt = self.format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                       "strict": fmt.strict, "description": fmt.description}}

    def echo(self) -> dict[str, Any]:
        """`text` as the Response object repeats it."""
        if self.format is None:
            return {"format": {"type": "text"}}
        return {"format": self.format.model_dump(by_alias=True, exclude_none=True)}


# A background response is fetched and resumed from the store, so it cannot go unstored.
BACKGROUND_NEEDS_STORE: JsonDict = {"not": {"required": ["background", "store"],
                                  "properties": {"background": {"const": True}, "store": {"const": False}}}}
REQUEST_RULES: JsonDict = {"allOf": [BACKGROUND_NEEDS_STORE, tool_rules("text")]}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=REQUEST_RULES)

    model: StrictStr
    input: StrictStr | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutputItem], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    metadata: Annotated[dict[Annotated[StrictStr, Field(max_length=MAX_METADATA_KEY_CHARS)],
                             Annotated[StrictStr, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
                        Field(max_length=MAX_METADATA_PAIRS)] | None = None
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    stream: StrictBool = False
    user: StrictStr | None = None
    text: TextOptions | None = None
    background: StrictBool = False
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # extensions, as on the other endpoints
    # within +-2**53: every JSON parser reads such an integer exactly (a bound near 2**63 is not even
    # representable as a double, and schema checkers disagree at its edge)
    seed: Annotated[StrictInt, Field(ge=-(2**53), le=2**53)] | None = None
    priority: Literal["interactive", "batch"] = "interactive"
    timeout: Annotated[float, Field(gt=0, le=3600)] | None = None
    ignore_eos: StrictBool = False

    def unsupported(self) -> str | None:
        """The first parameter this server does not serve (yet, or in this combination), if any."""
        if self.background and not self.store:
            return "store"
        return None

    def input_items(self) -> list[dict[str, Any]]:
        """This turn's input in stored form."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input).normalized()]
        return [item.normalized() for item in self.input]

    def chat_request(self, history: list[list[dict[str, Any]]]) -> ChatCompletionRequest:
        """This turn as a chat completion request. `history`: each earlier turn's input items followed by
        its output items (stored form), oldest first."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for items in history:
            messages += chat_messages(items)
        messages += chat_messages(self.input_items())
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                 for t in self.tools or []]
        choice: str | dict[str, Any] | None = (
            {"type": "function", "function": {"name": self.tool_choice.name}}
            if isinstance(self.tool_choice, FunctionToolChoice) else self.tool_choice)
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "user": self.user,
            "priority": self.priority, "timeout": self.timeout, "ignore_eos": self.ignore_eos,
            "response_format": self.text.response_format() if self.text else None,
            "tools": tools or None, "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls,
        })
