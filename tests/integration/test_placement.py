"""Prefix-aware placement on the real stack: two workers of one model, tenants with their own system prompts.

* Interleaved requests of four tenants land where their tenant's prefix is cached: from the second round on,
  every request is served from the cache (the `usage` events the ledger is built from carry cached tokens), on
  the worker that served its tenant first; two tenants sharing the text of one system prompt never hit each
  other's blocks (the gate made no prefix placement for the second one).
* The worker holding a hot prefix is killed mid-stream: the stream completes with the text of an undisturbed
  run, billed once, and the tenant's next request is served by the other worker.
"""
from __future__ import annotations

import re
import signal
import time
import urllib.request

import httpx
import pytest

from schemas import topics
from tests.integration.conftest import SMALL_POOL_MODEL
from tests.integration.faults import request_trails, stream_completion
from tests.integration.kafka_probe import wait_for_events
from tests.integration.processes import Service, free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.faults]

MODEL = SMALL_POOL_MODEL  # a pool of its own: the session's `tiny` worker is not part of it
WORDS = ("amber basalt cedar delta ember fjord garnet harbor indigo juniper kestrel lagoon meadow nectar onyx "
         "prairie quartz raven sierra tundra umber violet willow xenon yarrow zephyr").split()


def system_prompt(seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(90))


@pytest.fixture(scope="module")
def pool(stack, tiny_model_dir):
    ports = {name: free_port() for name in ("pool-a", "pool-b")}
    workers = {name: Service(name, ["serve", "worker", "--model", str(tiny_model_dir), "--model-name", MODEL,
                                    "--worker-id", f"test-placement-{name}", "--threads", "1",
                                    "--kv-cache-mb", "16", "--metrics-port", str(port)],
                             stack.env, stack.services["worker"].log_path.parent)
               for name, port in ports.items()}
    for w in workers.values():
        w.start()
    try:
        for w in workers.values():
            w.wait_log("serving")
        yield workers
    finally:
        for w in workers.values():
            w.stop()


def placements(stack) -> dict[str, float]:
    """The gate's tokenmill:placements counters for this test's model, by reason."""
    url = f"http://127.0.0.1:{stack.env['TOKENMILL_STREAMS_METRICS_PORT']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for labels, value in re.findall(r"^tokenmill:placements_total\{([^}]*)\} (\S+)$", text, re.M):
        if f'model="{MODEL}"' in labels:
            reason = re.search(r'reason="([^"]*)"', labels).group(1)
            found[reason] = found.get(reason, 0) + float(value)
    return found


def complete(stack, key: str, prompt: str, **extra) -> tuple[str, dict]:
    # a deadline inside the client's wait: a request the pool never serves answers 504 with its id
    r = httpx.post(f"{stack.base_url}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "timeout": 90,
                         **extra})
    assert r.status_code == 200, (r.text, request_trails(stack.services["worker"].log_path.parent,
                                                         [r.headers.get("x-request-id")]))
    return r.headers["x-request-id"], r.json()


def wait_placing(stack, key: str, timeout: float = 60) -> None:
    """Until the gate places this model's requests (it has seen both workers' partitions): probes with a
    prompt too short to cache anything."""
    deadline = time.monotonic() + timeout
    while True:
        before = placements(stack)
        complete(stack, key, "hello")
        after = placements(stack)
        if sum(after.get(r, 0) - before.get(r, 0) for r in ("prefix", "load", "full")) > 0:
            return
        assert time.monotonic() < deadline, f"the gate never placed a request of the pool: {after}"


def usage(request_ids: list[str]) -> dict[str, dict]:
    wanted = set(request_ids)
    events = wait_for_events(topics.USAGE.name, lambda e: e.record["request_id"] in wanted, count=len(wanted),
                             timeout=30)
    return {e.record["request_id"]: e.record for e in events}


def test_interleaved_tenants_are_served_where_their_prefix_is_and_never_from_another_tenants(stack, pool):
    # a and b share the text of one system prompt; c and d have their own
    texts = {"a": system_prompt(1), "b": system_prompt(1), "c": system_prompt(2), "d": system_prompt(3)}
    run = int(time.time())
    keys = {t: stack.issue_tenant(f"placement-{t}-{run}") for t in texts}
    for key in keys.values():
        wait_placing(stack, key)
    sent: list[tuple[int, str, str]] = []  # (round, tenant, request id)
    prefix_placements_for_b = None
    for rnd in range(3):
        for t, text in texts.items():
            before = placements(stack)
            rid, _ = complete(stack, keys[t], f"{text}\nquestion {rnd}:")
            if (rnd, t) == (0, "b"):
                prefix_placements_for_b = placements(stack).get("prefix", 0) - before.get("prefix", 0)
            sent.append((rnd, t, rid))
    billed = usage([rid for _, _, rid in sent])
    assert len(billed) == len(sent)
    first_worker = {t: billed[rid]["worker_id"] for rnd, t, rid in sent if rnd == 0}
    for rnd, t, rid in sent:
        rec = billed[rid]
        if rnd == 0:
            # nothing of this tenant was cached anywhere; a's identical text is salted with a's id
            assert rec["cached_tokens"] == 0, (t, rec)
        else:
            # all of the system prompt's full blocks came from the cache, on the worker that holds them
            assert rec["cached_tokens"] >= rec["prompt_tokens"] - 32, (rnd, t, rec)
            assert rec["worker_id"] == first_worker[t], (rnd, t, rec["worker_id"], first_worker)
    assert prefix_placements_for_b == 0  # the gate saw no hit for b in a's blocks
    # the four prefixes spread over both workers
    assert set(first_worker.values()) == {"test-placement-pool-a", "test-placement-pool-b"}


def test_killing_the_worker_that_holds_a_hot_prefix_moves_its_requests_to_the_other(stack, pool):
    key = stack.issue_tenant(f"placement-hot-{int(time.time())}")
    wait_placing(stack, key)
    prompt = f"{system_prompt(4)}\nwrite on:"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "temperature": 0.9, "seed": 4321,
            "ignore_eos": True}
    first, reference, _ = stream_completion(stack, body, key=key)
    holder_id = usage([first])[first]["worker_id"]
    holder = next(name for name in pool if holder_id.endswith(name))
    killed = []

    def kill_holder(request_id, tokens):
        if not killed and tokens >= 20:
            assert f"started request {request_id}" in pool[holder].log()  # it went where the prefix is
            pool[holder].kill(signal.SIGKILL)
            killed.append(request_id)

    rid, answer, _ = stream_completion(stack, body, on_token=kill_holder, key=key)
    assert killed, "the request finished before its worker could be killed"
    assert answer == reference
    billed = wait_for_events(topics.USAGE.name, lambda e: e.record["request_id"] == rid, count=2, timeout=8)
    assert len(billed) == 1 and billed[0].record["completion_tokens"] == 300
    survivor_id = next(f"test-placement-{name}" for name in pool if name != holder)
    assert billed[0].record["worker_id"] == survivor_id
    after, _ = complete(stack, key, f"{system_prompt(4)}\nagain:")
    assert usage([after])[after]["worker_id"] == survivor_id
