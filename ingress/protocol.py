"""The OpenAI request bodies tokenmill accepts, validated strictly (no silent coercion).

Extensions beyond OpenAI's fields (as vLLM offers them): top_k, min_p,
repetition_penalty, ignore_eos; and tokenmill's own `priority` and `timeout`.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from pydantic.config import JsonDict

Float = float  # strict mode: ints and floats, never strings
MAX_STOP = 4


class CompletionBody(BaseModel):
    """What chat and text completion requests share: the sampling parameters and how to answer."""
    model_config = ConfigDict(strict=True, extra="ignore")

    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP)] | None = None
    presence_penalty: Annotated[Float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] = 0.0
    # within +-2**53: every JSON parser reads such an integer exactly (a bound near 2**63 is not even
    # representable as a double, and schema checkers disagree at its edge)
    seed: Annotated[StrictInt, Field(ge=-(2**53), le=2**53)] | None = None
    user: StrictStr | None = None
    # extensions
    top_k: Annotated[StrictInt, Field(ge=-1, lt=2**31)] | None = None
    min_p: Annotated[Float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[Float, Field(gt=0, le=10)] = 1.0
    ignore_eos: StrictBool = False
    priority: Literal["interactive", "batch"] = "interactive"
    timeout: Annotated[Float, Field(gt=0, le=3600)] | None = None

    def sampling_spec(self, max_tokens: int, default_seed: int) -> dict:
        """The `sampling` record of InferenceRequested. Always seeded: a request regenerated after a
        worker crash, or resubmitted in a batch, must give the same tokens."""
        return {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else float(self.temperature),
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
            "top_k": self.top_k if self.top_k is not None else -1,
            "min_p": float(self.min_p), "presence_penalty": float(self.presence_penalty),
            "frequency_penalty": float(self.frequency_penalty),
            "repetition_penalty": float(self.repetition_penalty),
            "seed": self.seed if self.seed is not None else default_seed,
            "stop": self.stop_list(), "stop_token_ids": [], "ignore_eos": self.ignore_eos,
            "n": self.n, "logprobs": self.logprobs_count(),
        }

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError  # each body names its own field

    def logprobs_count(self) -> int | None:
        raise NotImplementedError

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: StrictStr


TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME)]
    arguments: StrictStr


class ToolCall(BaseModel):
    """A call an assistant message in the history made."""
    model_config = ConfigDict(strict=True, extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME)]
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


# Rules between fields, written into the published JSON schema so that a client generator or a fuzzer knows
# them; the server enforces each with a 400 naming the parameter (ingress/serving/tool_calls.py, request_builder.py).
JSON_SCHEMA_NEEDS_SCHEMA: JsonDict = {
    "if": {"required": ["type"], "properties": {"type": {"const": "json_schema"}}},
    "then": {"required": ["json_schema"], "properties": {"json_schema": {
        "type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}},
}


def tool_rules(format_field: str) -> JsonDict:
    """A `tool_choice` other than none/auto needs tools, and tools that may be called exclude a structured
    `format_field` (response_format, or text.format on the Responses API)."""
    structured: JsonDict = ({"type": "object", "required": ["type"], "properties": {"type": {"not": {"const": "text"}}}}
                  if format_field == "response_format" else
                  {"type": "object", "required": ["format"], "properties": {"format": {
                      "type": "object", "required": ["type"], "properties": {"type": {"not": {"const": "text"}}}}}})
    return {"allOf": [
        {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none", "auto"]}}}},
         "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
        {"not": {"required": ["tools", format_field], "properties": {
            "tools": {"type": "array", "minItems": 1}, "tool_choice": {"not": {"const": "none"}},
            format_field: structured}}},
    ]}


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: the answer is free text, any JSON object, or JSON matching a schema."""
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=JSON_SCHEMA_NEEDS_SCHEMA)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(CompletionBody):
    model_config = ConfigDict(json_schema_extra=tool_rules("response_format"))

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(CompletionBody):
    prompt: StrictStr | Annotated[list[StrictInt], Field(min_length=1)] | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    # OpenAI's, not served (a 400 says so); the schema allows only the values that change nothing
    echo: StrictBool = Field(False, json_schema_extra={"const": False})
    best_of: StrictInt | None = Field(None, json_schema_extra={"maximum": 1})
    suffix: StrictStr | None = Field(None, json_schema_extra={"maxLength": 0})

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs


CompletionBody.model_rebuild()
ResponseFormat.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


def _inline_refs(node, defs: dict):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref[len("#/$defs/"):]], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def openapi_body(model_cls: type[BaseModel]) -> dict:
    """`openapi_extra` for a route that parses its JSON body itself (to answer OpenAI-shaped errors):
    the request body of the OpenAPI schema, so clients and API fuzzers know its shape."""
    schema = model_cls.model_json_schema()
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _inline_refs(schema, defs)}}}}


def first_error(exc: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending parameter, the way OpenAI reports them."""
    err = exc.errors()[0]
    path = ".".join(str(p) for p in err["loc"] if not isinstance(p, str) or not p.startswith(("function-", "tagged")))
    # pydantic puts union branch names in loc; keep the path readable
    param = ".".join(part for part in path.split(".") if part not in {"str", "int", "float", "list[str]", "list[int]", "bool"} and "[" not in part) or None
    if err["type"] == "missing":
        return f"Missing required parameter: '{param}'.", param
    return f"Invalid value for '{param}': {err['msg']}.", param
