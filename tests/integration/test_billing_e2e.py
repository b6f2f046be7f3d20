"""The ledger through the whole stack: one row per request, billed tokens = tokens the client got."""
import time

import httpx
import openai
import pytest

from tests.support.ledger import ledger_rows

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "tiny"


def _ledger(stack, request_ids, timeout=30):
    return {r["request_id"]: r for r in ledger_rows(stack.billing_url, request_ids, timeout)}


def test_client_tokens_equal_billed_tokens_streamed_unstreamed_and_cancelled(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0)
    whole = client.completions.create(model=MODEL, prompt="bill me", max_tokens=7, extra_body={"ignore_eos": True})
    streamed_tokens = 0
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage:
            streamed_tokens = chunk.usage.completion_tokens
        last_id = chunk.id
    received = 0
    with httpx.stream("POST", f"{stack.base_url}/completions", headers={"Authorization": f"Bearer {stack.api_key}"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 1500, "stream": True, "ignore_eos": True},
                      timeout=60) as r:
        cancelled_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += 1
                if received == 2:
                    break
    ids = [whole.id.removeprefix("cmpl-"), last_id.removeprefix("chatcmpl-"), cancelled_id]
    rows = _ledger(stack, ids)
    assert set(rows) == set(ids)
    assert rows[ids[0]]["completion_tokens"] == whole.usage.completion_tokens == 7
    assert rows[ids[1]]["completion_tokens"] == streamed_tokens
    assert rows[ids[2]]["status"] == "cancelled"
    assert rows[ids[2]]["completion_tokens"] >= received
    assert all(r["tenant_id"] == "acme" for r in rows.values())


def test_a_tenant_sees_only_its_own_usage(stack):
    other_key = stack.issue_tenant("nosy")
    client = openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0)
    client.completions.create(model=MODEL, prompt="mine", max_tokens=2)
    deadline = time.monotonic() + 10
    while httpx.get(f"{stack.base_url}/models", headers={"Authorization": f"Bearer {other_key}"}).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while True:
        mine = httpx.get(f"{stack.base_url}/usage", headers={"Authorization": f"Bearer {stack.api_key}"})
        assert mine.status_code == 200, mine.text
        if mine.json()["total"]["requests"] >= 1:
            break
        assert time.monotonic() < deadline, mine.json()
        time.sleep(0.3)
    assert mine.json()["tenant_id"] == "acme"
    theirs = httpx.get(f"{stack.base_url}/usage", params={"tenant_id": "acme", "tenant": "acme"},
                       headers={"Authorization": f"Bearer {other_key}"})
    # The query parameters naming acme are dropped: nosy gets its own (empty) usage, never acme's.
    assert theirs.status_code == 200
    assert theirs.json()["tenant_id"] == "nosy"
    assert theirs.json()["total"]["requests"] == 0
    assert httpx.get(f"{stack.base_url}/usage").status_code == 401


def test_billing_metrics_count_inserted_rows(stack):
    text = httpx.get(f"{stack.billing_url}/metrics").text
    inserted = [line for line in text.splitlines() if line.startswith("tokenmill:billing_inserted_total ")]
    assert inserted and float(inserted[0].split()[1]) >= 1
