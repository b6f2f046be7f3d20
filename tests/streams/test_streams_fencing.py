"""An owner frozen past its session (SIGSTOP) and then woken releases nothing twice: the standby
that took over fenced it out, and what the woken owner decides is never committed."""
from __future__ import annotations

import os
import signal
from collections import Counter

import pytest

from tests.streams.harness import FakeWorker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ROOMY = {"max_concurrent": 100_000, "requests_per_minute": 100_000, "max_queued": 10_000}
REQUESTS = 24


def test_a_frozen_owner_woken_after_a_takeover_releases_nothing_twice(case):
    a = case.start_streams(name="streams-a")
    b = case.start_streams(name="streams-b", wait=False)
    b.wait_log("standby", timeout=60)
    case.pub.tenant("fenced", **ROOMY)
    # No worker yet: every request is admitted and waits in the owner's queue.
    records = [case.pub.request("fenced", case.model, flush=False) for _ in range(REQUESTS)]
    case.pub.flush()
    ids = {r["request_id"] for r in records}
    case.probe.wait(lambda: any(s.event.record["tenant_id"] == "fenced"
                                and s.event.record["in_flight_requests"] == REQUESTS
                                for s in case.probe.get(case.t.quota_state)),
                    timeout=30, what="every request admitted and queued")
    active, standby = (a, b) if a.log().count("scheduler active") > a.log().count("giving up") else (b, a)

    os.killpg(active.proc.pid, signal.SIGSTOP)  # the owner and its supervisor, frozen mid-ownership
    try:
        standby.wait_active(timeout=60, count=standby.log().count("scheduler active") + 1)
        # Capacity appears only now: the new owner releases every request.
        worker = FakeWorker(case.t, case.pub, case.model, slots=REQUESTS, service_s=0.1, completion_tokens=2)
        case.workers.append(worker.start())
        case.probe.wait(lambda: {r["request_id"] for _, r in worker.taken} >= ids, timeout=30,
                        what="the new owner released every request")
    finally:
        os.killpg(active.proc.pid, signal.SIGCONT)

    # Woken, the old owner still holds the same requests as queued, and reads the adverts that
    # came while it slept: it releases them, and finds out it was fenced when it commits (or, had it
    # not released anything, it gives the scheduler up when its group membership catches up).
    active.wait_any_log(("fenced", "giving up the scheduler"), timeout=60)
    case.probe.wait(lambda: len({s.event.record["request_id"] for s in case.probe.get(case.t.usage)} & ids)
                    == REQUESTS, timeout=30, what="every request finished")
    # Everything the woken owner produced was aborted: `work` holds each request once, and so did
    # the worker (both read committed records only, as every consumer of streams' outputs does).
    end = case.probe.end_offsets(case.t.work)
    case.probe.wait(lambda: case.probe.read_up_to(case.t.work, end), timeout=30, what="`work` read to its end")
    released = Counter(s.event.record["request_id"] for s in case.probe.get(case.t.work)
                       if s.event.record["request_id"] in ids)
    assert set(released) == ids
    assert max(released.values()) == 1, {rid: n for rid, n in released.items() if n > 1}
    assert max(Counter(r["request_id"] for _, r in worker.taken if r["request_id"] in ids).values()) == 1
    assert "fenced" in active.log()  # it did try: the case this test is about happened
