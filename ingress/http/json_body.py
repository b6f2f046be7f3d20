"""The one reading of a JSON request body (every JSON route, and each line of a batch file): numbers as
JSON means them (json_numbers.py), text that a tokenizer can take (no lone surrogates), a JSON object."""
from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from http_api.openai_errors import APIError
from ingress.http import json_numbers
from ingress.protocol import first_error

MAX_BODY_BYTES = 4 * 2**20
Body = TypeVar("Body", bound=BaseModel)


class NotJSON(ValueError):
    """The text is not JSON (the message says why), or is nested too deeply (`too_deep`)."""

    def __init__(self, message: str, too_deep: bool = False):
        super().__init__(message)
        self.too_deep = too_deep


def decode(raw: bytes | str) -> Any:
    """The JSON value of `raw`; NotJSON when it is none."""
    try:
        data = json_numbers.loads(raw)
        # JSON escapes can smuggle in lone surrogates, which are not text any tokenizer can take.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError, json.JSONDecodeError) as exc:
        raise NotJSON(str(exc)) from None
    except RecursionError:
        raise NotJSON("nested too deeply", too_deep=True) from None
    return data


async def read_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The request's body, at most `max_bytes` (a 413 past it, before it is read where the length is sent)."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, f"Request body exceeds {max_bytes} bytes.", code="request_too_large")
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise APIError(499, "The client closed the connection while sending the body.",
                       code="client_disconnected") from None
    if len(raw) > max_bytes:
        raise APIError(413, f"Request body exceeds {max_bytes} bytes.", code="request_too_large")
    return raw


async def read_object(request: Request, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request's body as a JSON object, or the 4xx that says why it is not one."""
    return decode_object(await read_body(request, max_bytes))


def decode_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object, or the 400 that says why it is not one."""
    try:
        data = decode(raw)
    except NotJSON as exc:
        if exc.too_deep:
            raise APIError(400, "The JSON body is nested too deeply.", code="invalid_json") from None
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return data


async def parse(request: Request, model_cls: type[Body]) -> Body:
    """The request's body validated as `model_cls`; a 400 naming the parameter otherwise."""
    data = await read_object(request)
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        message, param = first_error(exc)
        raise APIError(400, message, param=param, code="invalid_value") from None
