"""Schema-driven API fuzzing with schemathesis: no request the OpenAPI schema can describe, nor any
that breaks it, makes the public OpenAI endpoints of a live ingress answer 5xx, and every answer keeps
the published contract (all of schemathesis' checks: documented status codes, headers and content types,
schema-valid requests accepted and invalid ones refused, `Allow` on 405).

The schema is ingress's own `/openapi.json`, whose request bodies are the pydantic models ingress
validates with (`ingress.protocol.openapi_body`). schemathesis generates bodies that fit them
(positive mode) and bodies that violate them one constraint at a time (negative mode: wrong types,
out-of-range numbers, missing required fields, ...), plus headers. No answer may be a 5xx except the
documented 503 `deadline_exceeded` of a request whose own timeout passed; then every other check runs.
Valid generation requests are kept cheap: the served model's name is added to the schema as an example
and the completion length is clamped to a few tokens before sending. The admin listener is checked the
same way with the admin token.

tests/integration/test_fuzz.py keeps what a schema cannot express: raw garbage bodies (invalid
UTF-8, any JSON value, deep nesting), oversized bodies, slow and non-reading clients.
"""
from __future__ import annotations

import json
from collections import Counter
import zlib

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.core.transport import STREAM_CUT_SHORT_ATTRIBUTE
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import CHECKS, load_all_checks, not_a_server_error, positive_data_acceptance

from tests.integration.conftest import ADMIN_TOKEN

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "tiny"
PUBLIC = r"^/v1/(chat/completions|completions|models(/\{model\})?)$"
# Fewer examples per operation here: the suite's time budget (most of these are cheap 404s and 400s).
RESPONSES = r"^/v1/responses(/\{response_id\}(/input_items|/cancel)?)?$"
MAX_TOKENS = 3
ALLOWED_5XX = {(503, "deadline_exceeded")}
load_all_checks()
# Every check schemathesis has (`--checks all`), the 5xx one replaced by `_allowed`, which knows the one
# documented 5xx. The stateful ones (use-after-free, ...) need a recorded sequence and pass on single calls.
ALL_CHECKS = [check for check in CHECKS.get_all() if check is not not_a_server_error]
# Rules between values that no JSON schema can state, each refused with its own documented code: a named
# tool_choice among the tools, unique tool names, a caller's JSON schema the grammar engine can enforce, token
# ids within the model's vocabulary, a non-empty prompt for a model without a start token, a prompt within its
# context, an id that names a background response. A schema-valid request refused for one of
# these is not a contract failure; refused for anything else, it is.
BEYOND_THE_SCHEMA = {(400, "unknown_tool"), (400, "duplicate_tool_name"), (400, "invalid_response_format"),
                     (400, "token_out_of_vocabulary"), (400, "empty_prompt"), (400, "response_not_background"),
                     (413, "context_length_exceeded")}


@pytest.fixture(scope="module")
def api_key(stack):
    return stack.issue_tenant("schemathesis", requests_per_minute=10**6, tokens_per_minute=10**9,
                              max_concurrent=1000, max_queued=10**5, monthly_token_budget=10**15)


def _openapi() -> dict:
    """Ingress's OpenAPI schema, built in-process (the same app object the live ingress serves; a
    schema loaded lazily from the running one through a fixture needs pytest internals that pytest
    9 removed). test_live_schema_is_the_tested_one checks that they agree."""
    from ingress.app import IngressSettings, create_app

    # The schema does not depend on the served models; at collection no model may be built yet.
    raw = create_app(IngressSettings(models={}, secret=b"schema-only")).openapi()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        body = raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        # Most generated names miss; the served one makes many positive cases reach the queue.
        body["properties"]["model"]["examples"] = [MODEL]
    return raw


schema = schemathesis.openapi.from_dict(_openapi()).include(path_regex=PUBLIC)
responses_schema = schemathesis.openapi.from_dict(_openapi()).include(path_regex=RESPONSES)


@pytest.fixture(scope="module")
def target(stack, api_key):
    return {"base_url": stack.base_url.removesuffix("/v1"), "headers": {"Authorization": f"Bearer {api_key}"},
            "timeout": 60}


def _integral(value) -> bool:
    """An integer as the server reads JSON: 3 or 3.0 (ingress/http/json_numbers.py), never a bool."""
    return type(value) is int or (type(value) is float and value.is_integer())


def _cheap(case) -> None:
    """Clamp a valid completion length, so a body that passes validation generates only a few tokens."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and body["model"] != MODEL and zlib.crc32(json.dumps(body, default=str).encode()) % 2:
        body["model"] = MODEL
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(field)
        if _integral(value) and value > MAX_TOKENS:
            body[field] = MAX_TOKENS
    if _integral(body.get("n")) and 2 < body["n"] <= 16:
        body["n"] = 2
    # Absent or null lengths mean the server's default (hundreds of tokens): clamp those too.
    if "input" in body:
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_TOKENS
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens" if "messages" in body else "max_tokens"] = MAX_TOKENS


def _error_code(response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _allowed(response) -> bool:
    return response.status_code < 500 or (response.status_code, _error_code(response)) in ALLOWED_5XX


def _call_and_check(target, case) -> None:
    _cheap(case)
    response = case.call(**target)
    if not _allowed(response):
        case.validate_response(response, checks=[not_a_server_error])
        raise AssertionError(f"{response.status_code} for {case.method} {case.path}: {response.content[:500]!r}")
    checks = ALL_CHECKS
    if (response.status_code, _error_code(response)) in BEYOND_THE_SCHEMA:
        checks = [check for check in ALL_CHECKS if check is not positive_data_acceptance]
    case.validate_response(response, checks=checks, headers=target["headers"],
                           transport_kwargs={"base_url": target["base_url"], "headers": target["headers"]})
    _openai_shaped(response, case.path)


@schema.parametrize()
@settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_public_api_never_answers_5xx(target, case):
    _call_and_check(target, case)


@responses_schema.parametrize()
@settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_responses_api_never_answers_5xx(target, case):
    _call_and_check(target, case)


def _openai_shaped(response, path: str) -> None:
    """A 4xx carries an OpenAI error body; a streamed 200 ends as its protocol says ([DONE] for chat and
    completions, a final response event for the Responses API) and holds no server error."""
    text = response.content.decode("utf-8", "replace")
    if 400 <= response.status_code < 500:
        err = json.loads(text)["error"]
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and err["type"], err
        assert "param" in err and "code" in err, err
    elif response.status_code == 200:
        content_type = next((v[0] for k, v in response.headers.items() if k.lower() == "content-type"), "")
        if content_type.startswith("text/event-stream"):
            # schemathesis stops reading a stream after 20 events; only a stream it read whole must end.
            if not (getattr(response, "stream_cut_short", False) or getattr(response, STREAM_CUT_SHORT_ATTRIBUTE, False)):
                if path == "/v1/responses":
                    last = [line for line in text.splitlines() if line.startswith("event: ")][-1]
                    assert last in ("event: response.completed", "event: response.incomplete",
                                    "event: response.failed"), text[-300:]
                else:
                    assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            for line in text.splitlines():
                if line.startswith("data: {"):
                    assert json.loads(line[6:]).get("error", {}).get("type") not in ("server_error", "api_error"), line


def test_generated_cases_reach_past_validation_and_are_refused_by_it(target):
    """The generated bodies are meaningful, on every path: valid ones are served and invalid ones
    refused with 400. Generated here, not read from the fuzz test above, so it stands alone; each
    path gets its own examples (drawn from the whole schema at once, one path once got none valid)."""
    seen: Counter = Counter()
    for path, method in (("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET")):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if method == "GET" and mode is GenerationMode.NEGATIVE:
                continue  # no body or parameters to get wrong

            @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(case=schema[path][method].as_strategy(generation_mode=mode))
            def call(case):
                _cheap(case)
                if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
                    case.body["model"] = MODEL  # a valid body for a model that is not served is a 404
                seen[(case.path, case.call(**target).status_code)] += 1

            call()
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert seen[(path, 200)] > 0, dict(seen)
        assert seen[(path, 400)] > 0, dict(seen)
    assert seen[("/v1/models", 200)] > 0, dict(seen)


def test_live_schema_is_the_tested_one(stack):
    from ingress.app import IngressSettings, create_app

    live = httpx.get(stack.base_url.removesuffix("/v1") + "/openapi.json", timeout=10).json()
    built = create_app(IngressSettings(models={}, secret=b"schema-only")).openapi()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        assert live["paths"][path]["post"]["requestBody"] == built["paths"][path]["post"]["requestBody"]


def _admin_openapi() -> dict:
    from ingress.app import create_admin_app
    from ingress.context import IngressContext, IngressSettings

    return create_admin_app(IngressContext(IngressSettings(models={}, secret=b"schema-only"))).openapi()


admin_schema = schemathesis.openapi.from_dict(_admin_openapi())
# Fuzzing only here: the coverage phase's boundary cases of the tenant settings come to about 70 tenant changes,
# each reading the `tenants` topic back (about 0.7 s). The documented CLI run (docs/api_contract.md) has both.
admin_schema.config.phases.coverage.enabled = False


@pytest.fixture(scope="module")
def admin_target(stack):
    return {"base_url": stack.admin_url, "headers": {"Authorization": f"Bearer {ADMIN_TOKEN}"}, "timeout": 60}


@admin_schema.parametrize()
@settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_admin_api_keeps_its_contract(admin_target, case):
    """The operators' listener, with the admin token: the tenant settings body, /metrics as text, errors."""
    response = case.call(**admin_target)
    assert response.status_code < 500, response.text[:500]
    case.validate_response(response, checks=ALL_CHECKS, headers=admin_target["headers"],
                           transport_kwargs={"base_url": admin_target["base_url"], "headers": admin_target["headers"]})
