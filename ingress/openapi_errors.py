"""The error answers every public route can give, written into the OpenAPI document, so a client generator
or a fuzzer (schemathesis' "undocumented status code" check) can trust it: each in OpenAI's error format.

FastAPI documents a 422 of its own on routes with parameters; tokenmill never answers 422 (validation
errors are 400s in the OpenAI format), so that entry is taken out.
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

WHEN = {
    "400": "Malformed JSON, wrong types, missing fields or unsupported parameters",
    "401": "Missing, unknown or revoked API key",
    "403": "A model or priority class the tenant's plan does not allow; the tenant is disabled",
    "404": "Unknown model, response, batch or file",
    "405": "Method not allowed on this path",
    "413": "The prompt does not fit the model's context, or the body is too large",
    "429": "A rate, token, concurrency, budget or queue limit (with Retry-After)",
    "499": "The client closed the connection before the answer",
    "503": "Shed (the deadline passed before a GPU could start it) or the queue is unavailable (with Retry-After)",
    "504": "The request did not finish before its deadline",
}


def document_errors(app: FastAPI) -> None:
    """Have `app.openapi()` list the error answers on every operation."""

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
            schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
            schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
