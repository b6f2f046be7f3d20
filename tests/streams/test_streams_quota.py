"""Authoritative quota in streams: what slipped past the edge is rejected here."""
from __future__ import annotations

import math
import time
from collections import Counter

import pytest

from tests.streams.harness import FakeWorker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


LIMIT, PER_REQUEST = 2000, 100


def test_burst_of_200_admits_at_most_the_token_limit_other_tenant_unaffected_reservations_return_to_zero(case):
    # Tenants first: streams reads `tenants` to its end on takeover, so their limits hold from the
    # first request on (published after, they would race the burst; seen failing once).
    case.publisher().tenant("greedy", tokens_per_minute=LIMIT, max_concurrent=100_000, requests_per_minute=100_000,
                            max_queued=10_000)
    case.pub.tenant("bystander", max_concurrent=100_000)
    case.start_streams()
    t_start = time.time()
    ids, rej, admitted = burst_admits_at_most_the_limit(case, t_start)
    cancelled, short_ones = end_admitted_every_way(case, ids, rej, admitted)
    reservations_return_to_zero(case, t_start, admitted, cancelled, short_ones)


def burst_admits_at_most_the_limit(case, t_start):
    # no workers yet: everything admitted waits in the queue. Even requests get a short deadline.
    burst = [case.pub.request("greedy", case.model, prompt_tokens=50, max_tokens=50, reserved=PER_REQUEST,
                              deadline_s=2.5 if i % 2 == 0 else 60, flush=False) for i in range(200)]
    others = [case.pub.request("bystander", case.model, prompt_tokens=50, max_tokens=50, flush=False)
              for _ in range(5)]
    case.pub.flush()
    ids = {r["request_id"]: r for r in burst}

    def rejected():
        return {s.event.record["request_id"]: s.event.record for s in case.probe.get(case.t.replies, "RequestError")
                if s.event.record["request_id"] in ids and s.event.record["status_code"] == 429}
    # admitted requests must still be queued (no capacity), so every rejection has arrived once
    # the quota state shows all 200 counted, or rejections + admitted = 200
    case.probe.wait(lambda: len(rejected()) >= 200 - 2 * LIMIT // PER_REQUEST, timeout=20, what="rejections")
    time.sleep(0.5)
    rej = rejected()
    windows = math.floor(time.time() / 60) - math.floor(t_start / 60) + 1
    admitted = [rid for rid in ids if rid not in rej]
    assert all(r["code"] == "rate_limit_tokens" and r["error_type"] == "rate_limit_error" for r in rej.values())
    assert all(r["retry_after_s"] is not None and r["retry_after_s"] > 0 for r in rej.values())
    assert len(admitted) * PER_REQUEST <= LIMIT * windows, (len(admitted), windows)
    assert len(admitted) >= LIMIT // PER_REQUEST  # the limit itself was honoured, not undercut
    # the bystander was not rejected
    other_ids = {r["request_id"] for r in others}
    assert not [s for s in case.probe.get(case.t.replies, "RequestError") if s.event.record["request_id"] in other_ids]
    return ids, rej, admitted


def end_admitted_every_way(case, ids, rej, admitted):
    """Cancel three long-deadline requests, let the short ones shed, then let a worker finish the rest."""
    long_ones = [rid for rid in admitted if ids[rid]["deadline_ms"] - ids[rid]["arrived_at_ms"] > 10_000]
    short_ones = [rid for rid in admitted if rid not in long_ones]
    assert long_ones and short_ones
    cancelled = long_ones[:3]
    for rid in cancelled:
        case.pub.cancel("greedy", rid)

    def usage():
        return Counter((s.event.record["request_id"], s.event.record["status"])
                       for s in case.probe.get(case.t.usage) if s.event.record["request_id"] in ids)
    case.probe.wait(lambda: sum(1 for (r, st) in usage() if st == "shed") == len(short_ones), timeout=15,
                    what="short-deadline requests shed")
    worker = FakeWorker(case.t, case.pub, case.model, slots=4, service_s=0.05, completion_tokens=7).start()
    case.workers.append(worker)
    case.probe.wait(lambda: sum(usage().values()) == len(admitted), timeout=20, what="every admitted request ended")
    time.sleep(0.5)
    u = usage()
    for rid in admitted:
        expected = "cancelled" if rid in cancelled else "shed" if rid in short_ones else "finished"
        assert u[(rid, expected)] == 1 and sum(n for (r, _), n in u.items() if r == rid) == 1, (rid, expected)
    assert not [r for (r, _) in u if r in rej], "a rejected request must not produce a RequestCompleted"
    released = Counter(s.event.record["request_id"] for s in case.probe.get(case.t.work))
    assert all(released[rid] == (1 if rid not in cancelled and rid not in short_ones else 0) for rid in admitted)
    return cancelled, short_ones


def reservations_return_to_zero(case, t_start, admitted, cancelled, short_ones):
    def quota():
        states = [s.event.record for s in case.probe.get(case.t.quota_state) if s.event.record["tenant_id"] == "greedy"]
        return states[-1] if states else None
    case.probe.wait(lambda: (q := quota()) and q["in_flight_requests"] == 0 and q["in_flight_tokens"] == 0,
                    timeout=10, what="greedy's reservations back to zero")
    q = quota()
    assert (q["in_flight_requests"], q["in_flight_tokens"]) == (0, 0)
    # Only while the whole test ran in one quota window (fixed minutes): once the minute turned, the state
    # read here counts the new window, which the early settlements are not part of (this check failed
    # as tokens_in_window == 0 when the burst was counted one minute and the state read the next).
    if math.floor(time.time() / 60) == math.floor(t_start / 60):
        # settled usage: finished ones count 50 prompt + 7 completion, released-unused count 0
        finished = len(admitted) - len(cancelled) - len(short_ones)
        assert q["tokens_in_window"] == finished * 57
