"""Restart the Kafka broker under load: streams in flight finish (or fail explicitly), the stack
recovers by itself, and nothing is billed twice."""
import json
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx
import pytest

from schemas import topics
from tests.integration.conftest import ADMIN_TOKEN
from tests.integration.kafka_probe import wait_for_events

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.faults]

MODEL = "tiny"
# The stack must serve a new request within this long after the broker is back. Measured on the
# 2-core dev machine: 2-31 s, typically ~11 s (streams keeps its Faust group membership across the
# restart; what remains is the worker's `work` consumer group rejoining). See docs/streams.md.
RECOVERY_BOUND_S = 60.0


def _stream(stack, results, index):
    body = {"model": MODEL, "prompt": f"request {index}", "max_tokens": 300, "stream": True, "ignore_eos": True,
            "seed": index}
    tokens, finish, error, request_id = 0, None, None, None
    try:
        with httpx.stream("POST", f"{stack.base_url}/completions", json=body, timeout=180,
                          headers={"Authorization": f"Bearer {stack.api_key}"}) as r:
            request_id = r.headers.get("x-request-id")
            if r.status_code != 200:
                error = (r.status_code, r.read().decode())
            else:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = ("sse", chunk["error"])
                        continue
                    for choice in chunk["choices"]:
                        tokens += 1
                        finish = choice["finish_reason"] or finish
    except httpx.HTTPError as exc:
        error = ("transport", repr(exc))
    results[index] = {"request_id": request_id, "tokens": tokens, "finish": finish, "error": error}


def _probe(stack, back: float) -> tuple[float, float, str]:
    """One short request; (sent, done) in seconds after the broker was back, and its outcome."""
    sent = time.monotonic() - back
    try:
        r = httpx.post(f"{stack.base_url}/completions", headers={"Authorization": f"Bearer {stack.api_key}"},
                       json={"model": MODEL, "prompt": "after", "max_tokens": 3, "timeout": 10}, timeout=60)
        outcome = "ok" if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
    except httpx.HTTPError as exc:
        outcome = repr(exc)
    return sent, time.monotonic() - back, outcome


def _time_to_serve(stack, back: float, bound: float) -> tuple[float | None, list]:
    """Seconds from `back` until a new request was first served (None if not within `bound`).

    Probes start every second and run concurrently, so one that hangs (ingress holds a request up to
    its deadline plus a grace period) does not delay the next one."""
    probes = []
    with ThreadPoolExecutor(max_workers=8) as pool:
        pending = set()
        while time.monotonic() - back < bound:
            if len(pending) < 8:
                pending.add(pool.submit(_probe, stack, back))
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            probes += [f.result() for f in done]
            if any(outcome == "ok" for _, _, outcome in probes):
                break
        for f in pending:
            f.cancel()
        probes += [f.result() for f in pending if not f.cancelled()]
    served = [d for _, d, outcome in probes if outcome == "ok"]
    return (min(served) if served else None), sorted(probes)


def test_broker_restart_under_load(stack, local_kafka):
    if local_kafka is None:
        pytest.fail("this fault test needs the session's own broker (unset KAFKA_BOOTSTRAP_SERVERS)")
    results: dict[int, dict] = {}
    threads = [threading.Thread(target=_stream, args=(stack, results, i)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    local_kafka.stop()
    time.sleep(2.0)
    local_kafka.start()
    back = time.monotonic()

    # The stack serves new requests again by itself, soon, while the streams above are still in flight.
    served_after, probes = _time_to_serve(stack, back, RECOVERY_BOUND_S)
    print(f"broker restart: first new request served {served_after} s after the broker was back")
    assert served_after is not None and served_after < RECOVERY_BOUND_S, probes

    for t in threads:
        t.join(240)
    assert len(results) == 8
    # Every stream in flight survives the outage whole: the worker keeps generating into its
    # producer's buffer, and silence on `ingress-heartbeats` while the broker is away is not
    # taken for a dead ingress (gpu_consumers/reply_readers.py), so nothing is cancelled.
    for r in results.values():
        assert r["error"] is None and r["finish"] == "length" and r["tokens"] == 300, r
    finished = list(results.values())

    # Each request that started is completed exactly once on `usage` (billing dedups, but the
    # source should not even need it for requests that were never redelivered).
    ids = {r["request_id"] for r in results.values() if r["request_id"]}
    events = wait_for_events(topics.USAGE.name, lambda e: e.record["request_id"] in ids, count=len(ids) * 2,
                             timeout=15)
    per_request: dict[str, list] = {}
    for e in events:
        per_request.setdefault(e.record["request_id"], []).append(e.record)
    for r in finished:
        records = per_request.get(r["request_id"], [])
        assert records, f"no RequestCompleted for {r['request_id']}"
        assert {rec["completion_tokens"] for rec in records} == {300}
    rows = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = httpx.post(f"{stack.billing_url}/admin/ledger/lookup",
                          json={"request_ids": [r["request_id"] for r in finished]},
                          headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        if len(rows) == len(finished):
            break
        time.sleep(0.5)
    assert sorted(row["request_id"] for row in rows) == sorted(r["request_id"] for r in finished)
    assert all(row["completion_tokens"] == 300 for row in rows)
