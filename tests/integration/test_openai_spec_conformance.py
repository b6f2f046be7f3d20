"""Every body and every stream event the real stack sends, validated against OpenAI's own published API description
(`../shared/openai-spec/openapi.yaml`, tests/integration/openai_spec.py): the schema of the operation answered,
for its status and media type (a stream's events one by one, each Responses event also against its own event
schema). The same answers are checked against tokenmill's self-published `/openapi.json`, whose operations must
list every route exercised here.

The rule the spec sets and these cases hold tokenmill to: a key the schema requires is present (null only where
the schema allows null), and a key typed without null is left out rather than sent as null.

Without the spec file every test here fails (never skips).
"""
from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.integration.conftest import MODEL_NAME
from tests.integration.openai_spec import OpenAISpec, SpecMissing, Violation, openai_spec

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPORT = Path(__file__).resolve().parents[2] / ".local" / "openai-conformance.json"
USER = [{"role": "user", "content": "Name a colour."}]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 8}}}, "strict": True}}
COLOUR_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["colour"],
                 "properties": {"colour": {"type": "string", "maxLength": 10}}}
# Every Responses stream event type tokenmill emits; the cases below must have seen each one.
RESPONSE_EVENT_TYPES = {
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    "response.output_text.delta", "response.output_text.done", "response.content_part.done",
    "response.output_item.done", "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "response.completed", "response.incomplete", "response.failed",
}
# Where the spec cannot describe an answer at all, and tokenmill sends what OpenAI's own API sends. Each entry:
# (method, path, media type, JSON path of the value, the value) -> why. Counted apart in the report.
SPEC_GAPS = {
    ("POST", "/completions", "text/event-stream", "finish_reason", None):
        "The spec gives streamed completions the non-streamed shape ('both the streamed and non-streamed response "
        "objects share the same shape'), whose finish_reason is required and never null; a chunk sent before its "
        "choice has ended has no finish reason. OpenAI's API sends null there, as tokenmill does (chat chunks, "
        "which have their own schema, allow null).",
}


@dataclass
class Sample:
    """One body or one stream event tokenmill sent, and the OpenAI operation it answered."""
    label: str
    method: str
    path: str  # the spec's path template, without /v1
    status: int
    media_type: str
    instance: Any
    event_type: str | None = None


@dataclass
class Live:
    """Requests to the stack that record what came back."""
    stack: Any
    client: httpx.Client
    samples: list[Sample] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)  # answers with another status than the case expects

    def call(self, method: str, template: str, url: str | None = None, *, key: str | None = "tenant",
             label: str = "", expect: int | None = 200, **kwargs) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if key == "tenant":
            key = self.stack.api_key
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        r = self.client.request(method, self.stack.base_url + (url or template), headers=headers, **kwargs)
        if expect is not None and r.status_code != expect:
            self.unexpected.append(f"{method} {url or template}: {r.status_code} (expected {expect}) {r.text[:300]}")
        media = r.headers.get("content-type", "").split(";")[0]
        if media == "application/json":
            self.samples.append(Sample(label or f"{method} {template}", method, template, r.status_code, media,
                                       r.json()))
        return r

    def stream(self, method: str, template: str, url: str | None = None, *, label: str,
               on_event: Callable[[Any], None] | None = None, **kwargs) -> list[Any]:
        """A streamed answer's events, each recorded (and handed to `on_event` as it arrives); `[DONE]` ends a
        chat or completions stream."""
        events = []
        headers = {"Authorization": f"Bearer {self.stack.api_key}"}
        with self.client.stream(method, self.stack.base_url + (url or template), headers=headers, **kwargs) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            named = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    named = line.removeprefix("event:").strip()
                elif line.startswith("data:"):
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        continue
                    event = json.loads(data)
                    kind = event.get("type") if isinstance(event, dict) else None
                    if named is not None:
                        assert named == kind, (named, event)  # the SSE event name is the event's type
                    events.append(event)
                    self.samples.append(Sample(f"{label} event {kind or len(events)}", method, template, 200,
                                               "text/event-stream", event, kind))
                    named = None
                    if on_event is not None:
                        on_event(event)
        assert events, f"{label}: an empty stream"
        return events


# --- the cases: each exercises one route (or one family of answers) and records what came back ---

def models(live: Live) -> None:
    listed = live.call("GET", "/models").json()
    assert MODEL_NAME in [m["id"] for m in listed["data"]]
    live.call("GET", "/models/{model}", "/models/no-such-model", expect=404, label="GET /models/{model} unknown")
    one = live.call("GET", "/models/{model}", f"/models/{MODEL_NAME}")
    if one.status_code == 200:
        assert one.json()["id"] == MODEL_NAME


def chat_whole(live: Live) -> None:
    variants = {
        "plain": {},
        "n=2": {"n": 2, "temperature": 1.0, "seed": 1},
        "logprobs": {"logprobs": True, "top_logprobs": 2},
        "stop+seed": {"stop": ["\n", "."], "seed": 7, "temperature": 0},
        "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "colour", "schema": COLOUR_SCHEMA, "strict": True}}, "max_tokens": 40},
        "json_object": {"response_format": {"type": "json_object"}, "max_tokens": 12},
        "tools": {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                  "max_tokens": 40},
    }
    for name, extra in variants.items():
        body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 6, **extra}
        answer = live.call("POST", "/chat/completions", json=body, label=f"chat {name}").json()
        assert len(answer["choices"]) == body.get("n", 1)


def chat_streamed(live: Live) -> None:
    variants = {
        "include_usage": {"stream_options": {"include_usage": True}},
        "n=2+logprobs": {"n": 2, "logprobs": True, "top_logprobs": 1, "temperature": 1.0, "seed": 3},
        "tools": {"tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": 40,
                  "stream_options": {"include_usage": True}},
    }
    for name, extra in variants.items():
        body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 6, "stream": True, **extra}
        chunks = live.stream("POST", "/chat/completions", json=body, label=f"chat stream {name}")
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def completions(live: Live) -> None:
    for name, extra in {"plain": {}, "n=3": {"n": 3, "seed": 1}, "logprobs": {"logprobs": 2}}.items():
        live.call("POST", "/completions", json={"model": MODEL_NAME, "prompt": "def main(", "max_tokens": 5, **extra},
                  label=f"completions {name}")
    chunks = live.stream("POST", "/completions", label="completions stream", json={
        "model": MODEL_NAME, "prompt": "def main(", "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


def errors(live: Live) -> None:
    chat = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2}
    live.call("POST", "/chat/completions", key=None, json=chat, expect=401, label="401 missing key")
    live.call("POST", "/chat/completions", key="tm-000000000000-nope", json=chat, expect=401, label="401 bad key")
    live.call("POST", "/chat/completions", json={**chat, "model": "gpt-17"}, expect=404, label="404 model")
    live.call("POST", "/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"},
              expect=400, label="400 invalid json")
    live.call("POST", "/completions", json={"model": MODEL_NAME, "prompt": "x", "temperature": "hot"}, expect=400,
              label="400 invalid value")
    live.call("POST", "/chat/completions", json={**chat, "max_tokens": 10**6}, expect=413, label="413 context")
    live.call("GET", "/responses/{response_id}", "/responses/resp_nope", expect=404, label="404 response")
    live.call("GET", "/files/{file_id}", "/files/file-nope", expect=404, label="404 file")
    live.call("GET", "/batches/{batch_id}", "/batches/batch_nope", expect=404, label="404 batch")
    # 429: a tenant allowed one request a minute (a window may roll over between two: a third is refused then)
    key = live.stack.issue_tenant("spec-429", requests_per_minute=1)
    for _ in range(3):
        r = live.call("POST", "/chat/completions", key=key, json=chat, expect=None, label="429 rate limit")
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            break
        assert r.status_code == 200, r.text
    else:
        pytest.fail("a tenant allowed one request a minute was never refused")


def responses(live: Live) -> None:
    create = {"model": MODEL_NAME, "input": "Say hi.", "max_output_tokens": 6}
    first = live.call("POST", "/responses", json={**create, "instructions": "Be brief.", "metadata": {"k": "v"}},
                      label="responses create").json()
    live.call("POST", "/responses", json={**create, "user": "u-1", "temperature": 0.5},
              label="responses create with user")
    second = live.call("POST", "/responses", json={**create, "previous_response_id": first["id"]},
                       label="responses create previous_response_id").json()
    live.call("POST", "/responses", label="responses create json_schema", json={
        **create, "max_output_tokens": 40,
        "text": {"format": {"type": "json_schema", "name": "colour", "schema": COLOUR_SCHEMA, "strict": True}}})
    live.call("POST", "/responses", label="responses create tools", json={
        **create, "max_output_tokens": 40, "tools": [{"type": "function", **WEATHER_TOOL["function"]}],
        "tool_choice": "required"})
    live.call("GET", "/responses/{response_id}", f"/responses/{second['id']}")
    items = live.call("GET", "/responses/{response_id}/input_items", f"/responses/{second['id']}/input_items").json()
    assert items["data"]
    deleted = live.call("DELETE", "/responses/{response_id}", f"/responses/{first['id']}")
    assert deleted.json()["deleted"] is True


def responses_streamed(live: Live) -> None:
    create = {"model": MODEL_NAME, "input": "Say hi.", "stream": True}
    events = live.stream("POST", "/responses", label="responses stream", json={**create, "max_output_tokens": 12})
    assert events[0]["type"] == "response.created"
    live.stream("POST", "/responses", label="responses stream incomplete", json={**create, "max_output_tokens": 1})
    live.stream("POST", "/responses", label="responses stream tools", json={
        **create, "max_output_tokens": 40, "tools": [{"type": "function", **WEATHER_TOOL["function"]}],
        "tool_choice": "required"})
    # an answer that ends by itself (a random model under a small grammar: most seeds close it within 40 tokens)
    for seed in range(6):
        events = live.stream("POST", "/responses", label="responses stream completed", json={
            **create, "max_output_tokens": 40, "seed": seed,
            "text": {"format": {"type": "json_schema", "name": "colour", "schema": COLOUR_SCHEMA, "strict": True}}})
        if events[-1]["type"] == "response.completed":
            break
    # a background response: created queued, streamed again from its start, retrieved and cancelled
    queued = live.call("POST", "/responses", json={**create, "stream": False, "background": True,
                                                   "max_output_tokens": 6}, label="responses create background").json()
    live.stream("GET", "/responses/{response_id}", f"/responses/{queued['id']}?stream=true",
                label="responses background stream")
    live.call("GET", "/responses/{response_id}", f"/responses/{queued['id']}", label="responses retrieve background")
    live.call("POST", "/responses/{response_id}/cancel", f"/responses/{queued['id']}/cancel",
              label="responses cancel (already ended)")
    # a background response cancelled while its stream is read: the stream ends with response.failed
    # (ignore_eos: an answer that ended before the worker took the cancel is answered as it ended)
    long = live.call("POST", "/responses", json={**create, "stream": False, "background": True,
                                                 "max_output_tokens": 1500, "ignore_eos": True},
                     label="responses create background").json()

    def cancel_on_first_delta(event):
        if event.get("type") == "response.output_text.delta" and not getattr(cancel_on_first_delta, "done", False):
            cancel_on_first_delta.done = True
            live.call("POST", "/responses/{response_id}/cancel", f"/responses/{long['id']}/cancel",
                      label="responses cancel (running)")

    events = live.stream("GET", "/responses/{response_id}", f"/responses/{long['id']}?stream=true",
                         label="responses background stream cancelled", on_event=cancel_on_first_delta)
    assert events[-1]["type"] == "response.failed", events[-1]


def files_and_batches(live: Live) -> None:
    key = live.stack.issue_tenant("spec-batches", requests_per_minute=10**6, tokens_per_minute=10**9,
                                  max_concurrent=1000, max_queued=10**6, monthly_token_budget=10**12)
    live.call("GET", "/batches", key=key, label="GET /batches (none yet)")
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL_NAME, "messages": USER, "max_tokens": 2}}) for i in range(3)]
    content = ("\n".join(lines + ["not json"]) + "\n").encode()
    upload = live.call("POST", "/files", key=key, files={"file": ("spec.jsonl", content)}, data={"purpose": "batch"},
                       label="files create").json()
    live.call("GET", "/files", key=key)
    live.call("GET", "/files/{file_id}", f"/files/{upload['id']}", key=key)
    batch = live.call("POST", "/batches", key=key, label="batches create", json={
        "input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    deadline = time.monotonic() + 60
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        batch = live.call("GET", "/batches/{batch_id}", f"/batches/{batch['id']}", key=key,
                          label=f"batches retrieve ({batch['status']})").json()
    assert batch["status"] == "completed", batch
    live.call("GET", "/batches", key=key)
    big = "\n".join(json.dumps({"custom_id": f"x{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL_NAME, "messages": USER, "max_tokens": 32, "ignore_eos": True}}) for i in range(200))
    upload2 = live.call("POST", "/files", key=key, files={"file": ("big.jsonl", big.encode())},
                        data={"purpose": "batch"}, label="files create").json()
    doomed = live.call("POST", "/batches", key=key, label="batches create", json={
        "input_file_id": upload2["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    live.call("POST", "/batches/{batch_id}/cancel", f"/batches/{doomed['id']}/cancel", key=key)
    # a batch none of whose lines is a request: failed, with its errors
    upload3 = live.call("POST", "/files", key=key, files={"file": ("bad.jsonl", b"not json\n")},
                        data={"purpose": "batch"}, label="files create").json()
    failed = live.call("POST", "/batches", key=key, label="batches create (failed)", json={
        "input_file_id": upload3["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    assert failed["status"] == "failed" and failed["errors"]["data"], failed
    live.call("DELETE", "/files/{file_id}", f"/files/{upload['id']}", key=key)


CASES: dict[str, Callable[[Live], None]] = {fn.__name__: fn for fn in (
    models, chat_whole, chat_streamed, completions, errors, responses, responses_streamed, files_and_batches)}


# --- checking ---

def _gap(sample: Sample, violation: Violation) -> bool:
    """A violation that is one of SPEC_GAPS: the value at the violation's path is the gap's."""
    key = violation.path.rsplit(".", 1)[-1]
    try:
        value = _at(sample.instance, violation.path)
    except (KeyError, IndexError, TypeError):
        return False
    return any(gap[:4] == (sample.method, sample.path, sample.media_type, key) and gap[4] == value
               for gap in SPEC_GAPS)


def _at(instance: Any, json_path: str) -> Any:
    for part in re.findall(r"\.([^.\[]+)|\[(\d+)\]", json_path):
        name, index = part
        instance = instance[int(index)] if index else instance[name]
    return instance


def spec_violations(spec: OpenAISpec, sample: Sample) -> tuple[list[Violation], list[Violation]]:
    """The sample's violations of the spec, and apart from them those that are SPEC_GAPS."""
    found = _spec_violations(spec, sample)
    gaps = [v for v in found if _gap(sample, v)]
    return [v for v in found if v not in gaps], gaps


# Streams whose operation the spec describes with a `stream` parameter but whose events it declares elsewhere:
# `GET /responses/{id}?stream=true` sends the events `POST /responses` streams (the SDKs decode them as such).
STREAMS_AS = {("GET", "/responses/{response_id}"): ("POST", "/responses")}


def _spec_violations(spec: OpenAISpec, sample: Sample) -> list[Violation]:
    method, path = sample.method, sample.path
    if sample.media_type == "text/event-stream":
        method, path = STREAMS_AS.get((method, path), (method, path))
    pointer = spec.operation_schema(method, path, sample.status, sample.media_type)
    if pointer is None:  # the spec declares no body here (deleteResponse's 200): it must still be JSON
        return [] if isinstance(sample.instance, (dict, list)) else [Violation("$", "not a JSON document")]
    found = spec.violations(sample.instance, pointer)
    if sample.event_type is not None and sample.path in ("/responses", "/responses/{response_id}"):
        own = spec.stream_event_component(sample.event_type)
        if own is None:
            return [Violation("$.type", f"{sample.event_type!r} is no event type of the spec's ResponseStreamEvent")]
        found = spec.violations(sample.instance, own) or found
    return found


class OwnDocument:
    """tokenmill's `/openapi.json`: the response schema it publishes for each operation."""

    def __init__(self, document: dict[str, Any]):
        self.document = document
        self.registry = Registry().with_resource(
            "urn:tokenmill", Resource.from_contents(document, default_specification=DRAFT202012))

    def violations(self, sample: Sample) -> list[str]:
        operation = self.document["paths"].get("/v1" + sample.path, {}).get(sample.method.lower())
        if operation is None:
            return [f"tokenmill's /openapi.json has no {sample.method} /v1{sample.path}"]
        answer = operation["responses"].get(str(sample.status))
        if answer is None:
            return [f"tokenmill's /openapi.json lists no {sample.status} for {sample.method} /v1{sample.path}"]
        content = answer.get("content", {})
        if sample.media_type not in content:
            return [f"tokenmill's /openapi.json has no {sample.media_type} {sample.status} for "
                    f"{sample.method} /v1{sample.path}"]
        media = sample.media_type.replace("/", "~1")
        pointer = (f"urn:tokenmill#/paths/{('/v1' + sample.path).replace('~', '~0').replace('/', '~1')}/"
                   f"{sample.method.lower()}/responses/{sample.status}/content/{media}/schema")
        instance = sample.instance
        if sample.media_type == "text/event-stream":  # one event: its JSON document in `data`
            instance = {"data": json.dumps(sample.instance)}
            if sample.event_type:
                instance["event"] = sample.event_type
        validator = Draft202012Validator({"$ref": pointer}, registry=self.registry)
        return [f"{e.json_path}: {e.message[:200]}" for e in validator.iter_errors(instance)]


@pytest.fixture(scope="module")
def spec() -> OpenAISpec:
    return openai_spec()


@pytest.fixture(scope="module")
def own_document(stack) -> OwnDocument:
    return OwnDocument(httpx.get(stack.base_url.removesuffix("/v1") + "/openapi.json", timeout=30).json())


@pytest.fixture(scope="module")
def tally():
    counts: dict[str, Counter] = {}
    yield counts
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps({case: dict(c) for case, c in counts.items()}, indent=1))


@pytest.mark.parametrize("case", list(CASES))
def test_answers_conform_to_openai_spec(case, stack, spec, own_document, tally):
    with httpx.Client(timeout=120) as client:
        live = Live(stack, client)
        CASES[case](live)
    assert live.samples
    counts = tally.setdefault(case, Counter())
    failures = []
    for sample in live.samples:
        kind = "events" if sample.media_type == "text/event-stream" else "bodies"
        violations, gaps = spec_violations(spec, sample)
        problems = [f"OpenAI spec: {v}" for v in violations]
        problems += [f"own /openapi.json: {p}" for p in own_document.violations(sample)]
        counts[kind] += 1
        counts[f"{kind} conforming"] += not problems and not gaps
        counts[f"{kind} in a spec gap"] += not problems and bool(gaps)
        if problems:
            failures.append(f"{sample.label} ({sample.status}): " + "; ".join(sorted(set(problems))[:6]))
    seen = {s.event_type for s in live.samples if s.event_type}
    missing = sorted(RESPONSE_EVENT_TYPES - seen) if case == "responses_streamed" else []
    assert not live.unexpected and not failures and not missing, "\n".join(
        live.unexpected + [f"never streamed: {missing}"] * bool(missing)
        + [f"{len(failures)} of {len(live.samples)} answers break the spec:"] + sorted(set(failures)))


# --- the validator itself: it must catch what it is for, and refuse to run without the spec ---

def test_the_spec_file_is_required(tmp_path):
    with pytest.raises(SpecMissing):
        OpenAISpec.load(tmp_path / "openapi.yaml")


def test_the_validator_honours_nullable_refs_and_required_keys(spec):
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]}
    pointer = spec.operation_schema("POST", "/chat/completions", 200, "text/event-stream")
    assert spec.violations(chunk, pointer) == []  # `logprobs`: `type: object` with `nullable: true`
    assert spec.violations({**chunk, "created": None}, pointer)  # `created`: an integer, never null
    message = {"role": "assistant", "content": "hi"}  # `refusal` is required (nullable, so null is fine)
    whole = spec.operation_schema("POST", "/chat/completions", 200)
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}]}
    assert [v.message for v in spec.violations(body, whole)] == ["'refusal' is a required property"]
    body["choices"][0]["message"] = {**message, "refusal": None}
    assert spec.violations(body, whole) == []
    assert spec.stream_event_component("response.output_text.delta") is not None
    assert spec.stream_event_component("response.no_such_event") is None
