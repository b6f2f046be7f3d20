"""Issue 33, item 1, through the real stack with an attacker and a victim tenant: the Responses API's read
routes are metered and bounded per tenant. The attacker holds every replay it may (`GET ?stream=true` of a
background response that stays queued: no worker serves its model), is refused past its bound with a 429,
gets its slot back when it hangs up, and loops on GETs until its request rate refuses it; meanwhile the
victim's chat completions and its own replay go through. Behaviour only, no timing asserts."""
from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from tests.integration.conftest import MODEL_NAME, SMALL_POOL_MODEL

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPLAYS_PER_TENANT = 4  # TOKENMILL_REPLAYS_PER_TENANT's default
ATTACKER_RPM = 60


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _queued_forever(client: httpx.Client, base: str, key: str) -> str:
    """A background response that stays queued while the test runs: nothing serves SMALL_POOL_MODEL here."""
    r = client.post(f"{base}/responses", headers=_auth(key), json={
        "model": SMALL_POOL_MODEL, "input": "wait for a worker", "max_output_tokens": 4, "background": True,
        "timeout": 90})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "queued"
    return r.json()["id"]


def _chat_completes(client: httpx.Client, base: str, key: str) -> None:
    r = client.post(f"{base}/chat/completions", headers=_auth(key), json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def _replay(held: contextlib.ExitStack, client: httpx.Client, base: str, key: str, response_id: str) -> httpx.Response:
    """A replay held open (its headers read, its body not) until `held` closes it."""
    r = held.enter_context(client.stream("GET", f"{base}/responses/{response_id}?stream=true", headers=_auth(key)))
    if r.status_code != 200:
        r.read()
    return r


def test_an_attackers_replays_and_lookups_are_bounded_and_the_victims_requests_go_through(stack):
    attacker = stack.issue_tenant("hardening-attacker", requests_per_minute=ATTACKER_RPM)
    victim = stack.issue_tenant("hardening-victim")
    base = stack.base_url
    with httpx.Client(timeout=60) as client, contextlib.ExitStack() as held:
        target = _queued_forever(client, base, attacker)
        replays = [_replay(held, client, base, attacker, target) for _ in range(REPLAYS_PER_TENANT + 2)]
        assert [r.status_code for r in replays] == [200] * REPLAYS_PER_TENANT + [429, 429]
        refused = replays[-1]
        assert refused.json()["error"]["code"] == "too_many_replays" and refused.headers["Retry-After"] == "1"

        # The attacker holds all it may: the victim's chat completion and its own replay go through.
        _chat_completes(client, base, victim)
        # (a response that completes: a tenant's own queue is first come, first served, so one that can
        # never run would hold the victim's later chat requests behind it)
        r = client.post(f"{base}/responses", headers=_auth(victim), json={
            "model": MODEL_NAME, "input": "hello", "max_output_tokens": 4, "background": True})
        assert r.status_code == 200, r.text
        own = r.json()["id"]
        with contextlib.ExitStack() as victims:
            replayed = _replay(victims, client, base, victim, own)
            assert replayed.status_code == 200
            events = [json.loads(line[6:]) for line in replayed.iter_lines() if line.startswith("data: ")]
            assert events[0]["type"] == "response.created"
            assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        # Another tenant cannot replay (or even see) the attacker's response.
        with contextlib.ExitStack() as victims:
            assert _replay(victims, client, base, victim, target).status_code == 404

        # A replay whose client hangs up gives its slot back: the attacker may open one again.
        replays[0].close()
        deadline = time.monotonic() + 30
        while True:
            again = _replay(held, client, base, attacker, target)
            if again.status_code == 200:
                break
            assert again.json()["error"]["code"] == "too_many_replays", again.json()
            again.close()
            assert time.monotonic() < deadline, "the closed replay's slot never came back"
            time.sleep(0.2)
        held.close()

    # A lookup loop counts against the attacker's request rate, until a 429 stops it...
    with httpx.Client(timeout=60) as client:
        codes = []
        for _ in range(2 * ATTACKER_RPM + 10):  # the rate's window may roll over once meanwhile
            r = client.get(f"{base}/responses/{target}", headers=_auth(attacker))
            codes.append(r.status_code)
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "rate_limit_requests"
                assert int(r.headers["Retry-After"]) >= 1
                break
            assert r.status_code == 200, r.text
        assert codes[-1] == 429, f"{len(codes)} lookups and never refused"
        # ...which is the attacker's own: the victim's requests still go through.
        _chat_completes(client, base, victim)
        assert client.get(f"{base}/responses/{own}", headers=_auth(victim)).status_code == 200
