"""The queue survives a SIGKILL of streams, and a standby never double-releases."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.streams.harness import FakeWorker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ROOMY = {"max_concurrent": 100_000, "requests_per_minute": 100_000, "max_queued": 10_000}


def released_counts(case, ids):
    return Counter(s.event.record["request_id"] for s in case.probe.get(case.t.work)
                   if s.event.record["request_id"] in ids)


def finish_all_and_check(case, ids, worker):
    case.probe.wait(lambda: len(released_counts(case, ids)) == len(ids), timeout=60, what="every request released")
    case.probe.wait(lambda: len({s.event.record["request_id"] for s in case.probe.get(case.t.usage)
                                 if s.event.record["request_id"] in ids}) == len(ids), timeout=30,
                    what="every request finished")
    time.sleep(1.0)  # room for a late double release to show up
    counts = released_counts(case, ids)
    twice = {rid: n for rid, n in counts.items() if n > 1}
    assert not twice, f"released more than once: {twice}"
    assert set(counts) == set(ids), f"lost: {set(ids) - set(counts)}"
    errors = [s for s in case.probe.get(case.t.replies, "RequestError") if s.event.record["request_id"] in ids]
    assert not errors
    taken = Counter(r["request_id"] for _, r in worker.taken)
    assert all(taken[rid] == 1 for rid in ids)
    states = [s.event.record for s in case.probe.get(case.t.quota_state) if s.event.record["tenant_id"] == "durable"]
    case.probe.wait(lambda: [s.event.record for s in case.probe.get(case.t.quota_state)
                             if s.event.record["tenant_id"] == "durable"][-1]["in_flight_requests"] == 0,
                    timeout=10, what="reservations back to zero")
    del states


def test_sigkill_and_restart_mid_queue_loses_nothing_and_releases_nothing_twice(case):
    first = case.start_streams(name="streams-1")
    case.pub.tenant("durable", **ROOMY)
    worker = FakeWorker(case.t, case.pub, case.model, slots=3, service_s=0.15, completion_tokens=2).start()
    case.workers.append(worker)
    records = [case.pub.request("durable", case.model, flush=False) for _ in range(60)]
    case.pub.flush()
    ids = {r["request_id"] for r in records}
    case.probe.wait(lambda: len(released_counts(case, ids)) >= 12, timeout=20, what="some releases")
    first.kill()  # SIGKILL, mid-queue, while releases are flowing
    at_kill = len(released_counts(case, ids))
    assert at_kill < len(ids)
    second = case.start_streams(name="streams-2", wait=False)
    second.wait_active(timeout=60)
    finish_all_and_check(case, ids, worker)


def test_standby_does_not_release_and_takes_over_when_the_active_instance_dies(case):
    a = case.start_streams(name="streams-a")
    b = case.start_streams(name="streams-b", wait=False)
    b.wait_log("standby", timeout=60)
    case.pub.tenant("durable", **ROOMY)
    worker = FakeWorker(case.t, case.pub, case.model, slots=3, service_s=0.15, completion_tokens=2).start()
    case.workers.append(worker)
    # after the rebalance that b's join caused, exactly one of them is active
    time.sleep(1.0)
    records = [case.pub.request("durable", case.model, flush=False) for _ in range(45)]
    case.pub.flush()
    ids = {r["request_id"] for r in records}
    case.probe.wait(lambda: len(released_counts(case, ids)) >= 9, timeout=30, what="some releases")
    active = a if a.log().count("scheduler active") > a.log().count("giving up") else b
    standby = b if active is a else a
    active.kill()
    standby.wait_active(timeout=60, count=standby.log().count("scheduler active") + 1)
    finish_all_and_check(case, ids, worker)
