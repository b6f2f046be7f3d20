"""Errors in the OpenAI format, `{"error": {"message", "type", "param", "code"}}`, for every HTTP listener
(ingress's public and admin ones, billing's): the error type, and the handlers that answer every failure
(routing, parameter validation, an unexpected exception) in that format."""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tokenmill.http")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}
ROUTING = {404: ("Unknown path.", "unknown_url"), 405: ("Method not allowed on this path.", "method_not_allowed")}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type or ERROR_TYPES.get(status, "api_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _routes(routes):
    """Every route, including those of routers the app includes (FastAPI keeps an included router as one
    entry of app.routes, its own routes under `original_router`)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _routes(inner.routes)
        else:
            yield route


def from_http_exception(app: FastAPI, request: Request, exc: StarletteHTTPException) -> APIError:
    """An HTTPException (Starlette's unknown path or wrong method, or one a route raised) as an APIError."""
    message, code = str(exc.detail), None
    if exc.status_code in ROUTING and exc.detail == HTTPStatus(exc.status_code).phrase:
        message, code = ROUTING[exc.status_code]
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:  # RFC 9110: a 405 names the methods the path does allow
        allowed = {m for route in _routes(app.routes) if getattr(route, "path_regex", None) is not None
                   and route.path_regex.match(request.url.path) for m in (getattr(route, "methods", None) or ())}
        headers["Allow"] = ", ".join(sorted(allowed))
    return APIError(exc.status_code, message, code=code, headers=headers)


def from_validation_error(exc: RequestValidationError) -> APIError:
    """A query or path parameter FastAPI validated itself (JSON bodies are parsed by the routes)."""
    err = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
    return APIError(400, f"Invalid value for '{param}': {err.get('msg', 'invalid')}.", code="invalid_value",
                    param=param)


def answer_errors_in_openai_format(app: FastAPI, on_error: Callable[[APIError], None] | None = None) -> None:
    """Every error `app` answers, in the OpenAI format; `on_error` sees each APIError a route raised."""

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        if on_error is not None:
            on_error(exc)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return from_http_exception(app, request, exc).response()

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(_request: Request, exc: RequestValidationError):
        return from_validation_error(exc).response()

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, "The server had an error while processing your request.").response()
