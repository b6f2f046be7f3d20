"""The one place an `InferenceRequested` event is built, for an HTTP request and for a batch line
alike: what a request reserves, how its prefix cache is salted and its endpoint named."""
from __future__ import annotations

import json
from typing import Any

from http_api.openai_errors import APIError
from ingress.serving.tool_calls import tool_spec
from schemas import codec


def inference_requested(*, request_id: str, tenant: dict[str, Any], body, chat: bool, model: str,
                        prompt_token_ids: list[int], max_tokens: int, seed: int, priority: str,
                        arrived_at_ms: int, deadline_ms: int, reply_topic: str, reply_partition: int,
                        api_key_id: str | None, batch_id: str | None = None, custom_id: str | None = None,
                        reply_incarnation: str | None = None, adapter: dict[str, str] | None = None) -> dict[str, Any]:
    """`body` is the validated request (ChatCompletionRequest or CompletionRequest); `model` the served
    base model; `adapter` the tenant's LoRA adapter it runs with (an AdapterRef), if its model id names one."""
    return codec.new_event(
        "InferenceRequested", request_id=request_id,
        tenant_id=tenant["tenant_id"], model=model,
        endpoint="chat.completions" if chat else "completions",
        prompt_token_ids=prompt_token_ids,
        sampling=body.sampling_spec(max_tokens, seed),
        priority=priority, arrived_at_ms=arrived_at_ms, deadline_ms=deadline_ms,
        reply_topic=reply_topic, reply_partition=reply_partition,
        # The most tokens it can cost: quota holds this until the request settles at its actual use.
        reserved_tokens=len(prompt_token_ids) + max_tokens * body.n,
        # Tenants share cached prefixes only when they opted in (a hit is observable in latency).
        cache_salt=None if tenant.get("share_prefix_cache") else tenant["tenant_id"],
        api_key_id=api_key_id, batch_id=batch_id, custom_id=custom_id, released_at_ms=None,
        reply_incarnation=reply_incarnation,
        response_format=response_format_spec(body),
        adapter=adapter,
    )


def response_format_spec(body) -> str | None:
    """The structured-output spec the worker constrains the answer to (structured_outputs/grammars.py), as JSON
    text; None for free text."""
    spec = structured_spec(body)
    return None if spec is None else json.dumps(spec, sort_keys=True, separators=(",", ":"))


def structured_spec(body) -> dict | None:
    if getattr(body, "tools", None) is not None or getattr(body, "tool_choice", None) is not None:
        spec = tool_spec(body)
        if spec is not None:
            return spec
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    js = fmt.json_schema
    if js is None or js.schema_ is None:
        raise APIError(400, "response_format of type json_schema needs json_schema.schema.",
                       param="response_format.json_schema", code="invalid_value")
    return {"type": "json_schema", "schema": js.schema_, "strict": bool(js.strict)}
