"""Body limits count the bytes received: a chunked body without Content-Length is stopped at the
limit with a 413 in the OpenAI format, for JSON routes and multipart uploads alike."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from ingress.app import body_limit_for
from ingress.http.body_limit import BodyLimit
from http_api.openai_errors import APIError

LIMIT = 1000


def make_client() -> TestClient:
    app = FastAPI()
    app.add_middleware(BodyLimit, limit_for=lambda path: (LIMIT, "file_too_large" if "files" in path
                                                          else "request_too_large"))
    read: dict[str, int] = {}

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return exc.response()

    @app.post("/v1/echo")
    async def echo(request: Request):
        body = await request.body()
        read["bytes"] = len(body)
        return {"bytes": len(body)}

    @app.post("/v1/files")
    async def upload(request: Request):
        form = await request.form()
        return {"bytes": len(await form["file"].read())}

    client = TestClient(app)
    client.read = read
    return client


def chunks(n: int, size: int = 100):
    for _ in range(n):
        yield b"x" * size


def test_a_chunked_body_past_the_limit_is_refused_with_413():
    client = make_client()
    r = client.post("/v1/echo", content=chunks(50))  # 5,000 bytes, no Content-Length
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert "bytes" not in client.read  # the route never got a body


def test_a_body_within_the_limit_passes_whole():
    client = make_client()
    r = client.post("/v1/echo", content=chunks(9))
    assert r.status_code == 200 and r.json() == {"bytes": 900}


def test_a_multipart_upload_past_the_limit_is_refused_before_it_is_spooled_whole():
    client = make_client()
    r = client.post("/v1/files", files={"file": ("big.jsonl", b"y" * 5000)}, data={"purpose": "batch"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"


def test_uploads_get_the_file_limit_and_everything_else_the_json_limit():
    assert body_limit_for("/v1/files")[1] == "file_too_large"
    assert body_limit_for("/v1/batches") == body_limit_for("/v1/chat/completions")
    assert body_limit_for("/v1/files")[0] > body_limit_for("/v1/batches")[0]
