"""Reading and validating an OpenAI Batch input file, line by line.

Each line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}`. The body is validated with the same protocol
models and tokenized with the same `ServedModel` as ingress, so a line that would be
refused over HTTP is refused here too, with the same message. A bad line becomes a
`LineError` and never stops the rest of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from pydantic import ValidationError

from infra.config import default_max_tokens as configured_max_tokens
from structured_outputs.grammars import GrammarError
from http_api.openai_errors import APIError
from ingress.http import json_body
from ingress.serving.prompts import CHAT, TEXT, PromptKind, PromptTemplates, completion_length
from ingress.protocol import ChatCompletionRequest, CompletionBody, CompletionRequest, first_error

# url -> the body it takes and the kind of prompt that holds
ENDPOINTS: dict[str, tuple[type[CompletionBody], PromptKind]] = {
    "/v1/chat/completions": (ChatCompletionRequest, CHAT), "/v1/completions": (CompletionRequest, TEXT)}
MAX_CUSTOM_ID = 512


class ModelLike(PromptTemplates, Protocol):
    max_model_len: int


@dataclass(frozen=True)
class LineError:
    line: int               # 1-based line number in the input file
    custom_id: str | None
    code: str
    message: str
    param: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"line": self.line, "custom_id": self.custom_id, "code": self.code, "message": self.message,
                "param": self.param}


@dataclass
class PreparedLine:
    line: int
    custom_id: str
    chat: bool
    model: str               # the served model's name (after the model map; `<base>:<adapter>` for an adapter)
    requested_model: str     # the name in the file
    body: CompletionBody     # a ChatCompletionRequest or a CompletionRequest, as the endpoint says
    prompt_token_ids: list[int]
    max_tokens: int
    base_model: str = ""     # the base model it runs on ('' = `model` itself)
    adapter: dict[str, str] | None = None  # the tenant's LoRA adapter (an AdapterRef) `model` names

    @property
    def n(self) -> int:
        return self.body.n


@dataclass
class ParsedFile:
    lines: list[PreparedLine] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    total_lines: int = 0     # non-blank lines


def parse_model_map(text: str | None) -> dict[str, str]:
    """`gpt-4o-mini=tiny,gpt-4o=small` -> {"gpt-4o-mini": "tiny", ...}."""
    mapping: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        src, sep, dst = part.partition("=")
        if not sep or not src.strip() or not dst.strip():
            raise ValueError(f"model map entries look like 'name=served_name' (got {part!r})")
        mapping[src.strip()] = dst.strip()
    return mapping


def parse_file(content: bytes, models: Callable[[str], ModelLike | None], *, tenant: dict[str, Any],
               model_map: dict[str, str] | None = None, endpoint: str | None = None,
               adapters: Callable[[str, str], Any] | None = None,
               default_max_tokens: int | None = None) -> ParsedFile:
    """Every line of `content`, prepared or refused. `models(name)` gives a served model or None.

    `endpoint`, when given (the HTTP API's batch endpoint), is the only url a line may name.
    A custom_id belongs to the first line that names it; later lines with it are refused.
    """
    result = ParsedFile()
    seen: set[str] = set()
    if default_max_tokens is None:
        default_max_tokens = configured_max_tokens()
    text_lines = content.split(b"\n")
    for number, raw in enumerate(text_lines, start=1):
        if not raw.strip():
            continue
        result.total_lines += 1
        outcome = _parse_line(number, raw, Models(models, adapters), tenant, model_map or {}, endpoint,
                              default_max_tokens, seen)
        if isinstance(outcome, LineError):
            result.errors.append(outcome)
        else:
            result.lines.append(outcome)
    return result


def _envelope(number: int, raw: bytes, endpoint: str | None, seen: set[str]) -> tuple[str, str, Any] | LineError:
    """A line's custom_id, url and body, checked; the first line naming a custom_id owns it."""
    def err(code: str, message: str, custom_id=None, param=None) -> LineError:
        return LineError(number, custom_id, code, message, param)

    try:
        data = json_body.decode(raw)
    except json_body.NotJSON as exc:  # one line's fault: the rest of the batch goes on
        return err("invalid_json", f"Line {number} is nested too deeply." if exc.too_deep
                   else f"Line {number} is not valid JSON: {exc}.")
    if not isinstance(data, dict):
        return err("invalid_json", f"Line {number} must be a JSON object.")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return err("missing_custom_id", "Each line needs a non-empty string 'custom_id'.", param="custom_id")
    if len(custom_id) > MAX_CUSTOM_ID:
        return err("invalid_custom_id", f"custom_id is longer than {MAX_CUSTOM_ID} characters.", param="custom_id")
    if custom_id in seen:
        return err("duplicate_custom_id", f"custom_id {custom_id!r} appears on an earlier line; "
                                          "each request needs its own custom_id.", custom_id, "custom_id")
    seen.add(custom_id)
    method = data.get("method")
    if not isinstance(method, str) or method.upper() != "POST":
        return err("invalid_method", f"method must be 'POST' (got {method!r}).", custom_id, "method")
    url = data.get("url")
    if url not in ENDPOINTS:
        return err("invalid_url", f"url must be one of {sorted(ENDPOINTS)} (got {url!r}).", custom_id, "url")
    if endpoint is not None and url != endpoint:
        return err("mismatched_url", f"url {url!r} differs from the batch's endpoint {endpoint!r}.",
                   custom_id, "url")
    body = data.get("body")
    if not isinstance(body, dict):
        return err("invalid_body", "body must be a JSON object.", custom_id, "body")
    return custom_id, url, body


@dataclass(frozen=True)
class Models:
    """What a line's model id may name: a served model (`served`), or one of the tenant's LoRA adapters as
    `<base>:<adapter>` (`adapters(tenant_id, model id)` gives its manifest or None; another tenant's adapter
    is not found, exactly like an unknown model)."""
    served: Callable[[str], ModelLike | None]
    adapters: Callable[[str, str], Any] | None = None


def _parse_line(number: int, raw: bytes, models: Models, tenant, model_map, endpoint, default_max_tokens,
                seen: set[str]) -> PreparedLine | LineError:
    envelope = _envelope(number, raw, endpoint, seen)
    if isinstance(envelope, LineError):
        return envelope
    custom_id, url, body = envelope

    def err(code: str, message: str, param=None) -> LineError:
        return LineError(number, custom_id, code, message, param)

    body_type, kind = ENDPOINTS[url]
    try:
        request = body_type.model_validate(body)
    except ValidationError as exc:
        message, param = first_error(exc)
        return err("invalid_value", message, param)
    if request.stream:
        return err("unsupported_parameter", "stream is not supported in a batch.", "stream")
    served = model_map.get(request.model, request.model)
    try:
        kind.refuse_unsupported(request)
        model, base, adapter = _allowed_model(models, tenant, served, request.model)
        # a bad schema or tool is this line's error, found before anything is queued
        prompt = _prompt(model, request, kind, tenant.get("tenant_id"))
        max_tokens = completion_length(model, prompt, request.requested_max_tokens(), default_max_tokens, kind.param)
    except APIError as exc:
        return err(exc.code or "invalid_value", exc.message, exc.param)
    except GrammarError as exc:
        return err("invalid_response_format", str(exc), exc.param)
    return PreparedLine(line=number, custom_id=custom_id, chat=kind.chat, model=served, requested_model=request.model,
                        body=request, prompt_token_ids=list(prompt), max_tokens=max_tokens, base_model=base,
                        adapter=adapter)


def _allowed_model(models: Models, tenant: dict[str, Any], served: str,
                   requested: str) -> tuple[ModelLike, str, dict[str, str] | None]:
    """(the model, the base model's name, the adapter's AdapterRef or None), as ingress resolves a request's."""
    base, adapter = served, None
    model = models.served(served)
    if model is None and models.adapters is not None:
        manifest = models.adapters(tenant.get("tenant_id") or "", served)
        if manifest is not None:
            base = manifest["base_model"]
            model = models.served(base)
            adapter = {"adapter_id": manifest["adapter_id"], "name": manifest["name"], "version": manifest["version"]}
    if model is None:
        raise APIError(404, f"The model '{requested}' does not exist.", code="model_not_found", param="model")
    allowed = tenant.get("allowed_models") or []
    if allowed and served not in allowed and base not in allowed:
        raise APIError(403, f"Your plan does not include the model '{served}'.", code="model_not_allowed",
                       param="model")
    return model, base, adapter


def _prompt(model: ModelLike, request, kind: PromptKind, tenant_id: str | None) -> list[int]:
    """The line's prompt token ids, its output constraint compiled first where the model has a compiler
    (in the tenant's share of the compile slots, as a request's is)."""
    prompt = kind.token_ids(model, request)
    spec = kind.constraint(request)
    grammars = getattr(model, "grammars", None)
    if spec is not None and grammars is not None:
        grammars.compile(spec, tenant=tenant_id)
    return prompt
