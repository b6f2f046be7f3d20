"""Offline batches through the real stack: submit -> requests -> streams -> work -> worker -> batch-results."""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from tokenmill.batch_cli import main as batch_main
from schemas import topics
from tests.integration.kafka_probe import wait_for_events

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[2]
BIG_LIMITS = dict(requests_per_minute=10_000_000, tokens_per_minute=1_000_000_000, max_queued=1_000_000,
                  max_concurrent=1_000_000, monthly_token_budget=10**12)


@pytest.fixture(scope="module")
def batch_env(stack, tmp_path_factory):
    """The CLI runs in this process: point it at the stack's models and a fresh batch directory."""
    saved = {k: os.environ.get(k) for k in ("TOKENMILL_MODELS", "TOKENMILL_BATCH_DIR")}
    os.environ["TOKENMILL_MODELS"] = stack.env["TOKENMILL_MODELS"]
    os.environ["TOKENMILL_BATCH_DIR"] = str(tmp_path_factory.mktemp("batches"))
    yield Path(os.environ["TOKENMILL_BATCH_DIR"])
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def batch_key(stack):
    return stack.issue_tenant("batchco", **BIG_LIMITS)


def chat_line(custom_id: str, content: str, max_tokens: int = 2, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": content}],
                                "max_tokens": max_tokens, "temperature": 0, **extra}})


def completion_line(custom_id: str, prompt: str, max_tokens: int = 2) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}})


def submit(path: Path, key: str, capsys) -> str:
    capsys.readouterr()
    assert batch_main(["submit", str(path), "--api-key", key]) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def completions_of(batch_id: str, expected: int, timeout: float = 30) -> list[dict]:
    """Every RequestCompleted of the batch on `usage` (waits for `expected`, then a little longer for extras)."""
    events = wait_for_events(topics.USAGE.name, lambda e: e.name == "RequestCompleted"
                             and e.record["batch_id"] == batch_id, count=expected, timeout=timeout)
    extra = wait_for_events(topics.USAGE.name, lambda e: e.name == "RequestCompleted"
                            and e.record["batch_id"] == batch_id, count=expected + 1, timeout=3)
    return [e.record for e in (extra if len(extra) > len(events) else events)]


def test_thousand_line_batch_completes_once_per_custom_id(batch_env, batch_key, tmp_path, capsys):
    n = 1000
    good = [chat_line(f"req-{i}", f"q{i}") if i % 4 else completion_line(f"req-{i}", f"p{i}") for i in range(n)]
    bad = ["{this is not json", chat_line("req-7", "duplicate custom id"),
           json.dumps({"custom_id": "unknown", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}}),
           chat_line("too-long", "hello", max_tokens=100_000),
           json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {}})]
    lines = good[:10] + bad + good[10:]
    src = tmp_path / "input.jsonl"
    src.write_text("\n".join(lines) + "\n")

    started = time.monotonic()
    batch_id = submit(src, batch_key, capsys)
    submitted = time.monotonic()
    assert batch_id.startswith("batch_")

    out = tmp_path / "output.jsonl"
    assert batch_main(["collect", batch_id, "-o", str(out), "--timeout", "240", "--interval", "0.5"]) == 0
    finished = time.monotonic()
    print(f"\nsubmit {submitted - started:.1f}s, run+collect {finished - submitted:.1f}s for {n} requests")

    results = read_jsonl(out)
    assert sorted(r["custom_id"] for r in results) == sorted(f"req-{i}" for i in range(n))
    assert [r["custom_id"] for r in results] == [json.loads(l)["custom_id"] for l in lines
                                                 if l in good]  # input order
    for r in results:
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == ("text_completion" if int(r["custom_id"][4:]) % 4 == 0 else "chat.completion")
        assert 1 <= body["usage"]["completion_tokens"] <= 2
        assert body["id"].endswith(r["response"]["request_id"])

    errors = read_jsonl(out.with_name("output.errors.jsonl"))
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [
        (11, "invalid_json"), (12, "duplicate_custom_id"), (13, "model_not_found"), (14, "context_length_exceeded"),
        (15, "invalid_url")]

    capsys.readouterr()
    assert batch_main(["status", batch_id, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["status"] == "completed"
    assert status["counts"]["total"] == n + len(bad) and status["counts"]["completed"] == n
    assert status["counts"]["failed"] == len(bad) and status["counts"]["in_progress"] == 0

    # The same file again: the same batch id, nothing published twice, nothing run twice.
    assert submit(src, batch_key, capsys) == batch_id
    done = completions_of(batch_id, n)
    counts = Counter(r["request_id"] for r in done)
    assert len(counts) == n and set(counts.values()) == {1}
    assert {r["status"] for r in done} == {"finished"} and {r["priority"] for r in done} == {"batch"}

    # Collect is re-runnable and rewrites the same file.
    again = tmp_path / "again.jsonl"
    assert batch_main(["collect", batch_id, "-o", str(again)]) == 0
    assert again.read_bytes() == out.read_bytes()


def test_cancel_stops_queued_requests(batch_env, batch_key, tmp_path, capsys):
    n, max_tokens = 2000, 64  # far more work than the tiny worker finishes before the cancel lands
    src = tmp_path / "cancel.jsonl"
    src.write_text("\n".join(chat_line(f"c-{i}", f"cancel me {i}", max_tokens=max_tokens, ignore_eos=True)
                             for i in range(n)) + "\n")
    batch_id = submit(src, batch_key, capsys)
    # Cancel once work is under way (one request finished), so the cancel meets running work too.
    assert wait_for_events(topics.USAGE.name, lambda e: e.name == "RequestCompleted"
                           and e.record["batch_id"] == batch_id, count=1, timeout=60)
    assert batch_main(["cancel", batch_id]) == 0
    out = tmp_path / "cancel_out.jsonl"
    assert batch_main(["collect", batch_id, "-o", str(out), "--timeout", "90", "--interval", "0.5"]) == 0
    capsys.readouterr()
    batch_main(["status", batch_id, "--json"])
    status = json.loads(capsys.readouterr().out)
    assert status["status"] == "cancelled"
    completed, cancelled = status["counts"]["completed"], status["counts"]["cancelled"]
    assert completed + cancelled == n and cancelled > 0 and completed < n
    assert len(read_jsonl(out)) == completed
    errors = read_jsonl(out.with_name("cancel_out.errors.jsonl"))
    assert len(errors) == cancelled and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    # Only what ran is billed: one RequestCompleted per request, most of them cancelled without tokens.
    ended = completions_of(batch_id, n)
    assert len({r["request_id"] for r in ended}) == len(ended) == n
    by_status = Counter(r["status"] for r in ended)
    assert by_status["finished"] == completed and by_status["cancelled"] == cancelled
    assert sum(r["completion_tokens"] for r in ended if r["status"] == "cancelled") < cancelled * max_tokens


def test_batch_through_the_openai_sdk(stack, batch_key, batch_env, tiny_model_dir):
    """Files and batches over HTTP with the official client (the stack's ingress if it mounts the
    router, else an in-process app around a real Ingress)."""
    asyncio.run(_sdk_flow(stack, batch_key, tiny_model_dir, batch_env))


async def _sdk_flow(stack, key, tiny_model_dir, batch_dir):
    from fastapi import FastAPI

    mounted = "batch_router" in (ROOT / "ingress" / "app.py").read_text()
    ingress = None
    if mounted:
        make = lambda k: openai.AsyncOpenAI(base_url=stack.base_url, api_key=k, max_retries=0, timeout=60)
    else:
        from ingress.api.batches.routes import router as batch_router, serving_batches
        from ingress.api.batches.store import BatchStore
        from ingress.context import IngressContext, IngressSettings
        from infra.config import ModelSpec

        ingress = IngressContext(IngressSettings(reply_partition=15, models={MODEL: ModelSpec(MODEL, tiny_model_dir)}))
        await ingress.start()
        app = FastAPI()
        app.state.context, app.state.batches = ingress, serving_batches(ingress, BatchStore(batch_dir / "http"))
        app.include_router(batch_router)
        transport = httpx.ASGITransport(app=app)
        make = lambda k: openai.AsyncOpenAI(base_url="http://ingress.test/v1", api_key=k, max_retries=0,
                                            http_client=httpx.AsyncClient(transport=transport, timeout=60))
    try:
        client = make(key)
        content = "\n".join([chat_line(f"sdk-{i}", f"sdk {i}") for i in range(20)] + ["oops"]) + "\n"
        uploaded = await client.files.create(file=("sdk.jsonl", content.encode()), purpose="batch")
        assert uploaded.bytes == len(content.encode()) and uploaded.purpose == "batch"
        assert (await client.files.retrieve(uploaded.id)).filename == "sdk.jsonl"
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"job": "sdk-test"})
        assert batch.status in ("in_progress", "completed") and batch.request_counts.total == 21
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            batch = await client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.completed == 20 and batch.request_counts.failed == 1
        assert batch.metadata == {"job": "sdk-test"}
        output = [json.loads(l) for l in (await client.files.content(batch.output_file_id)).text.splitlines()]
        assert [o["custom_id"] for o in output] == [f"sdk-{i}" for i in range(20)]
        assert all(o["response"]["body"]["object"] == "chat.completion" for o in output)
        errors = [json.loads(l) for l in (await client.files.content(batch.error_file_id)).text.splitlines()]
        assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [(21, "invalid_json")]
        assert batch.id in [b.id async for b in client.batches.list()]

        # Cancel over HTTP: far more work than runs before the cancel lands.
        big = "\n".join(chat_line(f"x-{i}", f"long {i}", max_tokens=64, ignore_eos=True) for i in range(600))
        upload = await client.files.create(file=("big.jsonl", big.encode()), purpose="batch")
        doomed = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                             completion_window="1h")
        doomed = await client.batches.cancel(doomed.id)
        assert doomed.status in ("cancelling", "cancelled") and doomed.cancelling_at is not None
        deadline = time.monotonic() + 90
        while doomed.status == "cancelling" and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            doomed = await client.batches.retrieve(doomed.id)
        assert doomed.status == "cancelled" and doomed.cancelled_at is not None
        assert 0 < doomed.request_counts.failed and doomed.request_counts.completed < 600
        assert doomed.request_counts.completed + doomed.request_counts.failed == 600

        # Another tenant sees none of it.
        other = make(stack.issue_tenant("snoop", **BIG_LIMITS))  # returned once the stack's ingress has it
        for call in (lambda: other.batches.retrieve(batch.id), lambda: other.files.retrieve(uploaded.id),
                     lambda: other.files.content(batch.output_file_id)):
            with pytest.raises(openai.NotFoundError):
                await _retry_auth(call)  # an in-process ingress learns it on its own
    finally:
        if ingress is not None:
            await ingress.stop()


async def _retry_auth(call, timeout: float = 15):
    """The new tenant's key may not have reached ingress yet: retry 401s only."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except openai.AuthenticationError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


def test_structured_output_and_tool_lines_in_a_batch(stack, batch_key):
    """response_format and tools work in a batch as in a request; a bad schema is that line's error."""
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    tool = {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["n"],
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
    lines = [chat_line(f"json-{i}", "answer", max_tokens=40, temperature=1.0, seed=i,
                       response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
             for i in range(4)]
    lines += [chat_line(f"tool-{i}", "call", max_tokens=60, temperature=1.0, seed=i, tools=[tool],
                        tool_choice="required", parallel_tool_calls=False) for i in range(4)]
    lines.append(chat_line("bad", "x", response_format={"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "array", "uniqueItems": True}}}))

    async def flow():
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key=batch_key, max_retries=0, timeout=60)
        uploaded = await client.files.create(file=("structured.jsonl", ("\n".join(lines) + "\n").encode()),
                                             purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        deadline = time.monotonic() + 90
        while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            batch = await client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        output = (await client.files.content(batch.output_file_id)).text.splitlines()
        errors = (await client.files.content(batch.error_file_id)).text.splitlines()
        return [json.loads(line) for line in output], [json.loads(line) for line in errors]

    output, errors = asyncio.run(flow())
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("bad", "invalid_response_format")]
    by_id = {o["custom_id"]: o["response"]["body"]["choices"][0] for o in output}
    assert set(by_id) == {f"json-{i}" for i in range(4)} | {f"tool-{i}" for i in range(4)}
    for i in range(4):
        answer = by_id[f"json-{i}"]
        if answer["finish_reason"] == "stop":
            jsonschema.validate(json.loads(answer["message"]["content"]), schema)
        call = by_id[f"tool-{i}"]
        if call["finish_reason"] != "length":
            assert call["finish_reason"] == "tool_calls"
            [made] = call["message"]["tool_calls"]
            assert made["function"]["name"] == "ping" and 0 <= json.loads(made["function"]["arguments"])["n"] <= 9
