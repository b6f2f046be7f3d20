"""What the OpenAPI document says beyond what FastAPI derives from the routes, so a client generator or a
fuzzer (schemathesis) can trust it:

- the error answers every route can give, each in OpenAI's error format. FastAPI documents a 422 of its
  own on routes with parameters; tokenmill never answers 422 (validation errors are 400s in the OpenAI
  format), so that entry is taken out.
- links from each create operation (`POST /v1/files`, `/v1/batches`, `/v1/responses`) to the operations on
  what it created (`/v1/responses/{response_id}`, ...), the created object's `id` as the path parameter, so
  a client (or a fuzzer's stateful phase) can follow them.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}

# The 200 of an operation that can stream (`stream: true`): a JSON object, or server-sent events.
STREAMABLE: dict[int | str, dict[str, Any]] = {200: {
    "description": "The answer; with stream=true, its events (text/event-stream)", "content": {
    "application/json": {"schema": {"type": "object"}},
    # one event (OpenAPI 3.1 has the schema of an event stream describe each event): a JSON document in `data`
    "text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"}, "data": {"type": "string", "contentMediaType": "application/json"}}}}}}}

WHEN = {
    "400": "Malformed JSON, wrong types, missing fields or unsupported parameters; and the rules between values "
           "no JSON schema states, each with its own code: unknown_tool (a named tool_choice not among the tools), "
           "duplicate_tool_name, invalid_response_format (a JSON schema the grammar engine cannot enforce), "
           "token_out_of_vocabulary, empty_prompt (a model without a start token), response_not_background "
           "(streaming again or cancelling a response that was not created in the background)",
    "401": "Missing, unknown or revoked API key",
    "403": "A model or priority class the tenant's plan does not allow; the tenant is disabled",
    "404": "Unknown model, response, batch or file",
    "405": "Method not allowed on this path",
    "413": "The prompt does not fit the model's context (context_length_exceeded), or the body is too large",
    "429": "A rate, token, concurrency, budget or queue limit (with Retry-After)",
    "499": "The client closed the connection before the answer",
    "503": "Shed (the deadline passed before a GPU could start it) or the queue is unavailable (with Retry-After)",
    "504": "The request did not finish before its deadline",
}


def document_contract(app: FastAPI) -> None:
    """Have `app.openapi()` list the error answers on every operation, and the links from each create."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    answers = operation.setdefault("responses", {})
                    answers.pop("422", None)
                    for status, description in WHEN.items():
                        answers.setdefault(status, {"description": description, "content": {
                            "application/json": {"schema": ERROR_SCHEMA}}})
            _link_created_objects(schema.get("paths", {}))
            schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
            schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its document


def _link_created_objects(paths: dict[str, Any]) -> None:
    for collection, operations in paths.items():
        create = operations.get("post")
        if create is None or "{" in collection:
            continue
        links = {}
        for path, item_operations in paths.items():
            prefix, _, rest = path.partition(collection + "/{")
            if prefix or not rest:
                continue
            parameter = rest.split("}", 1)[0]
            for operation in item_operations.values():
                links[operation["operationId"]] = {"operationId": operation["operationId"],
                                                   "parameters": {parameter: "$response.body#/id"}}
        if links:
            create["responses"]["200"]["links"] = links
