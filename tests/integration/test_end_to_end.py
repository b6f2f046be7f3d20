"""A request through the real stack: ingress -> requests -> streams -> work -> worker -> replies."""
import time

import httpx
import openai
import pytest

from schemas import topics
from tests.integration.conftest import REAL_MODEL, SMALL_POOL_MODEL
from tests.integration.kafka_probe import wait_for_events

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "tiny"


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0, timeout=60)


def _usage_for(request_id: str, timeout: float = 30):
    events = wait_for_events(topics.USAGE.name, lambda e: e.record["request_id"] == request_id, timeout=timeout)
    assert len(events) == 1, f"no RequestCompleted for {request_id}"
    return events[0].record


def test_models_lists_the_served_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, SMALL_POOL_MODEL, REAL_MODEL]  # as TOKENMILL_MODELS names them


def test_streamed_chat_matches_unstreamed_and_is_billed(client):
    messages = [{"role": "user", "content": "Tell me about Kafka, naïvely 🎉"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, seed=7)
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens <= 12

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, seed=7,
                                            stream=True, stream_options={"include_usage": True})
    text, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    assert "".join(text) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens

    billed = _usage_for(whole.id.removeprefix("chatcmpl-"))
    assert billed["status"] == "finished"
    assert billed["completion_tokens"] == whole.usage.completion_tokens
    assert billed["prompt_tokens"] == whole.usage.prompt_tokens
    assert billed["tenant_id"] == "acme"


def test_streamed_completion(client):
    stream = client.completions.create(model=MODEL, prompt="def main(", max_tokens=9, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 9
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_n_choices_each_finish(client):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, n=3, temperature=1.0, seed=1,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 15


def _post(stack, path, body=None, key="default", raw=None):
    headers = {"Content-Type": "application/json"}
    if key == "default":
        key = stack.api_key
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{stack.base_url}{path}", headers=headers, content=raw, json=body, timeout=30)


@pytest.mark.parametrize(
    "body,raw,key,status,code",
    [
        (None, b"{not json", "default", 400, "invalid_json"),
        (None, b"\xff\xfe\x00", "default", 400, "invalid_json"),
        (None, b"[1, 2]", "default", 400, "invalid_json"),
        ({"model": MODEL}, None, "default", 400, "invalid_value"),
        ({"model": MODEL, "messages": "hi"}, None, "default", 400, "invalid_value"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, None, "default", 400,
         "invalid_value"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, None, "default", 400,
         "invalid_value"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, None, None, 401, "missing_api_key"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, None, "tm-000000000000-nope", 401,
         "invalid_api_key"),
        ({"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}, None, "default", 404,
         "model_not_found"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, None, "default", 413,
         "context_length_exceeded"),
    ],
)
def test_bad_input_gets_openai_error(stack, body, raw, key, status, code):
    r = _post(stack, "/chat/completions", body=body, raw=raw, key=key)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code
    assert err["message"] and err["type"]


def test_huge_prompt_is_413(stack):
    r = _post(stack, "/completions", {"model": MODEL, "prompt": "word " * 5000, "max_tokens": 4})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_out_of_vocabulary_token_ids_rejected(stack):
    r = _post(stack, "/completions", {"model": MODEL, "prompt": [1, 2, 10**9], "max_tokens": 4})
    assert r.status_code == 400


def test_client_disconnect_cancels_and_bills_what_ran(stack):
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    request_id = None
    received = 0
    with httpx.stream("POST", f"{stack.base_url}/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += 1
            if received >= 3:
                break
    cancelled = wait_for_events(topics.CANCELLATIONS.name, lambda e: e.record["request_id"] == request_id)
    assert cancelled and cancelled[0].record["reason"] == "client_disconnected"
    billed = _usage_for(request_id)
    assert billed["status"] == "cancelled"
    assert received <= billed["completion_tokens"] < 1500


def test_revoked_key_refused_within_a_second(stack):
    from ingress.tenancy.tenant_admin import TenantAdmin
    from tests.integration.conftest import TEST_SECRET

    key = stack.issue_tenant("revoke-me")  # returned once ingress accepts it
    headers = {"Authorization": f"Bearer {key}"}
    TenantAdmin(TEST_SECRET.encode()).revoke_key(key.split("-")[1])
    revoked_at = time.monotonic()
    while httpx.get(f"{stack.base_url}/models", headers=headers).status_code != 401:
        time.sleep(0.02)
        assert time.monotonic() - revoked_at < 1.0, "revocation took longer than a second"


def test_metrics_count_what_was_served(stack, client):
    def sample(name):
        text = httpx.get(f"{stack.admin_url}/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    before = sample("tokenmill:time_to_first_token_seconds_count")
    tokens_before = sample("tokenmill:generation_tokens_total")
    out = client.completions.create(model=MODEL, prompt="count me", max_tokens=4, extra_body={"ignore_eos": True})
    assert sample("tokenmill:time_to_first_token_seconds_count") == before + 1
    assert sample("tokenmill:generation_tokens_total") == tokens_before + out.usage.completion_tokens


def test_logprobs_are_the_sampled_tokens_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=5, logprobs=1, temperature=1.0, seed=3,
                                    extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs.token_logprobs
    assert len(logprobs) == 5
    assert all(lp <= 0 for lp in logprobs) and any(lp < -1e-6 for lp in logprobs)
