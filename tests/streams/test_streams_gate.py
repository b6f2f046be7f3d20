"""The gate's decisions without Kafka: quota, credits, dedupe, shedding, restore."""
from __future__ import annotations

import uuid

from schemas import codec
from streams.config import StreamsSettings
from streams.credits import PoolCredits
from streams.gate import Gate

NOW = 1_800_000_000.0  # a fixed clock, inside one minute window
MODEL = "m"


def settings(**kw) -> StreamsSettings:
    return StreamsSettings(topic_prefix="", metrics_port=0, **kw)


def request(tenant="a", *, max_tokens=8, prompt=8, priority="interactive", deadline=NOW + 60, rid=None,
            reserved=None) -> dict:
    record = codec.new_event(
        "InferenceRequested", request_id=rid or uuid.uuid4().hex, tenant_id=tenant, model=MODEL,
        prompt_token_ids=list(range(prompt)), sampling={"max_tokens": max_tokens}, priority=priority,
        arrived_at_ms=int(NOW * 1000), deadline_ms=int(deadline * 1000), reply_topic="replies", reply_partition=3,
        reserved_tokens=prompt + max_tokens if reserved is None else reserved)
    return codec.decode(*codec.encode("InferenceRequested", record)).record


def tenant(tenant_id, **fields) -> dict:
    rec = codec.decode(*codec.encode("TenantSnapshot", codec.new_event("TenantSnapshot", tenant_id=tenant_id))).record
    rec.update(fields)
    return rec


def advert(free, consumed, worker="w1", inc="i1", ts=NOW, stopping=False) -> dict:
    return {"worker_id": worker, "incarnation": inc, "model": MODEL, "free_slots": free, "free_kv_blocks": 100,
            "consumed_total": consumed, "timestamp_ms": int(ts * 1000), "stopping": stopping}


def outputs(gate, kind=None):
    return [o for o in gate.take_outputs() if kind is None or o.event == kind]


def test_credits_count_in_transit_until_an_advert_shows_the_worker_took_it_in():
    c = PoolCredits()
    c.on_advert(advert(2, 0))
    assert c.available(NOW) == {MODEL: 2}
    c.on_release(MODEL, "r1", NOW)
    c.on_release(MODEL, "r2", NOW)
    assert c.available(NOW) == {MODEL: 0}
    c.on_advert(advert(2, 0, ts=NOW + 0.01))  # written before the worker saw them: no new credit
    assert c.available(NOW) == {MODEL: 0}
    c.on_advert(advert(0, 2, ts=NOW + 0.02))  # took both in
    assert c.available(NOW) == {MODEL: 0} and c.in_transit(MODEL) == 0
    c.on_advert(advert(1, 2, ts=NOW + 0.5))  # one finished
    assert c.available(NOW + 0.5) == {MODEL: 1}


def test_credits_dead_or_stopping_or_stale_workers_grant_nothing():
    c = PoolCredits(advert_ttl_s=5)
    c.on_advert(advert(3, 0))
    assert c.available(NOW + 6) == {}
    c.on_advert(advert(3, 0, worker="w2", ts=NOW + 6, stopping=True))
    assert c.available(NOW + 6) == {}
    # a new incarnation replaces the old one of the same worker id
    c.on_advert(advert(4, 0, worker="w1", inc="i2", ts=NOW + 6))
    assert c.available(NOW + 6) == {MODEL: 4}


def test_in_transit_expires_so_a_busy_partition_cannot_block_the_pool_forever():
    c = PoolCredits(in_transit_ttl_s=3)
    c.on_advert(advert(1, 0, ts=NOW + 4))
    c.on_release(MODEL, "r1", NOW)
    assert c.available(NOW + 1) == {MODEL: 0}
    c.expire(NOW + 4)
    assert c.available(NOW + 4) == {MODEL: 1}


def test_release_only_against_credits_and_no_workers_means_waiting():
    g = Gate(settings())
    for _ in range(3):
        g.on_request(request(), NOW)
    g.step(NOW)
    assert outputs(g, "InferenceRequested") == []  # no adverts: nothing released
    g.handle("capacity", None, advert(2, 0), NOW)
    g.step(NOW + 0.01)
    work = outputs(g, "InferenceRequested")
    assert len(work) == 2 and all(o.record["released_at_ms"] for o in work)
    g.step(NOW + 0.02)
    assert outputs(g, "InferenceRequested") == []


def test_rejects_over_the_token_limit_with_429_and_no_usage_event():
    g = Gate(settings())
    g.handle("tenants", b"a", tenant("a", tokens_per_minute=100), NOW)
    g.on_request(request(max_tokens=42, prompt=8), NOW)  # 50
    g.on_request(request(max_tokens=42, prompt=8), NOW)  # 100
    g.on_request(request(max_tokens=42, prompt=8), NOW)  # 150: over
    out = outputs(g)
    errors = [o for o in out if o.event == "RequestError"]
    assert len(errors) == 1
    err = errors[0]
    assert (err.record["status_code"], err.record["error_type"], err.record["code"]) == (
        429, "rate_limit_error", "rate_limit_tokens")
    assert err.record["retry_after_s"] is not None and err.topic == "replies" and err.partition == 3
    assert not [o for o in out if o.event == "RequestCompleted"]
    assert g.ledger.in_flight("a") == (100, 2)


def test_queue_cap_rejects_with_queue_full():
    g = Gate(settings())
    g.handle("tenants", b"a", tenant("a", max_queued=2), NOW)
    for _ in range(3):
        g.on_request(request(), NOW)
    errors = outputs(g, "RequestError")
    assert [e.record["code"] for e in errors] == ["queue_full"]
    assert errors[0].record["status_code"] == 429


def test_shed_at_deadline_answers_503_ends_once_and_releases_the_reservation():
    g = Gate(settings())
    r = request(deadline=NOW + 1)
    g.on_request(r, NOW)
    g.step(NOW + 0.5)
    assert outputs(g, "RequestError") == []
    g.handle("capacity", None, advert(5, 0, ts=NOW + 1), NOW + 1)
    g.step(NOW + 1.0)  # deadline reached: shed, never released
    out = outputs(g)
    assert not [o for o in out if o.event == "InferenceRequested"]
    err = [o for o in out if o.event == "RequestError"][0].record
    assert (err["status_code"], err["error_type"], err["code"]) == (503, "service_unavailable", "deadline_exceeded")
    done = [o for o in out if o.event == "RequestCompleted"]
    assert len(done) == 1 and done[0].record["status"] == "shed" and done[0].record["completion_tokens"] == 0
    assert g.ledger.in_flight("a") == (0, 0)
    g.on_request(r, NOW + 1.1)  # redelivered: ignored
    g.step(NOW + 1.2)
    assert outputs(g) == [] or all(o.event == "QuotaState" for o in outputs(g))


def test_cancel_while_queued_ends_as_cancelled_and_cancel_before_request_is_remembered():
    g = Gate(settings())
    r = request()
    g.on_request(r, NOW)
    g.on_cancel({"request_id": r["request_id"]}, NOW)
    done = outputs(g, "RequestCompleted")
    assert len(done) == 1 and done[0].record["status"] == "cancelled"
    assert g.ledger.in_flight("a") == (0, 0) and len(g.queue) == 0
    early = request()
    g.on_cancel({"request_id": early["request_id"]}, NOW)
    g.on_request(early, NOW)
    assert [o.record["status"] for o in outputs(g, "RequestCompleted")] == ["cancelled"]
    assert len(g.queue) == 0


def test_usage_settles_to_actual_tokens_and_corrects_the_vtc_charge():
    g = Gate(settings())
    g.handle("capacity", None, advert(5, 0), NOW)
    r = request(max_tokens=100, prompt=10)
    g.on_request(r, NOW)
    g.step(NOW)
    charged = g.queue.counter("a")
    assert charged == 10 + 2 * 100
    g.on_usage({"request_id": r["request_id"], "prompt_tokens": 10, "completion_tokens": 5, "cached_tokens": 0}, NOW)
    assert g.queue.counter("a") == 10 + 2 * 5
    assert g.ledger.in_flight("a") == (0, 0)
    assert g.ledger.usage("a", NOW).used_tokens_in_window == 15
    g.on_usage({"request_id": r["request_id"], "prompt_tokens": 10, "completion_tokens": 5, "cached_tokens": 0}, NOW)
    assert g.ledger.usage("a", NOW).used_tokens_in_window == 15  # duplicate usage changes nothing


def test_state_written_as_entries_restores_the_same_queue_and_ledger():
    s = settings()
    g = Gate(s)
    table: dict = {}

    def flush():
        for k, v in g.take_dirty().items():
            if v is None:
                table.pop(k, None)
            else:
                table[k] = v

    g.handle("tenants", b"b", tenant("b", fairness_weight=2.0), NOW)
    reqs = [request("a"), request("b", priority="batch"), request("a"), request("b")]
    for r in reqs:
        g.on_request(r, NOW)
    g.handle("capacity", None, advert(1, 0), NOW)
    g.step(NOW)
    released = [o.key for o in outputs(g, "InferenceRequested")]
    assert len(released) == 1
    flush()
    h = Gate(s, dict(table))
    h.handle("tenants", b"b", tenant("b", fairness_weight=2.0), NOW)
    assert set(h.records) == set(g.records) and set(h.released) == set(released)
    assert h.ledger.in_flight("a") == g.ledger.in_flight("a") and h.ledger.in_flight("b") == g.ledger.in_flight("b")
    assert h.queue.counter("a") == g.queue.counter("a") and h.queue.counter("b") == g.queue.counter("b")
    # both make the same next decisions
    for gate in (g, h):
        gate.handle("capacity", None, advert(3, 1, ts=NOW + 0.1), NOW + 0.1)
        gate.step(NOW + 0.1)
    assert [o.key for o in outputs(g, "InferenceRequested")] == [o.key for o in outputs(h, "InferenceRequested")]


def test_requests_found_in_work_on_takeover_are_never_released_again():
    g = Gate(settings())
    r1, r2 = request(), request()
    g.on_request(r1, NOW)
    # r1 is queued here but a crashed owner had already released it; r2 is not even read yet
    g.mark_in_work([r1["request_id"], r2["request_id"]], NOW)
    g.on_request(r2, NOW)
    g.handle("capacity", None, advert(5, 0), NOW)
    g.step(NOW)
    assert outputs(g, "InferenceRequested") == []
    assert set(g.released) == {r1["request_id"], r2["request_id"]}
    for r in (r1, r2):
        g.on_usage({"request_id": r["request_id"], "prompt_tokens": 8, "completion_tokens": 1}, NOW)
    assert g.ledger.in_flight("a") == (0, 0)


def test_month_to_date_from_the_ledger_enforces_the_monthly_budget():
    g = Gate(settings())
    g.handle("tenants", b"a", tenant("a", monthly_token_budget=1000, tokens_per_minute=10**6), NOW)
    g.on_request(request(max_tokens=42, prompt=8), NOW)  # fits: nothing billed yet
    assert not [o for o in outputs(g) if o.event == "RequestError"]
    # billing says 980 tokens were already used this month (e.g. before streams' state was reset)
    g.apply_ledger_month("a", 980, NOW + 1)
    g.on_request(request(max_tokens=42, prompt=8), NOW + 1)
    errors = [o for o in outputs(g) if o.event == "RequestError"]
    assert [e.record["code"] for e in errors] == ["monthly_budget_exceeded"]


def test_a_disabled_tenants_work_is_refused_and_what_it_had_queued_or_running_is_stopped():
    g = Gate(settings())
    g.handle("capacity", None, advert(1, 0), NOW)
    running, queued = request("a"), request("a")
    g.on_request(running, NOW)
    g.on_request(queued, NOW)
    g.step(NOW)
    assert [o.record["request_id"] for o in outputs(g, "InferenceRequested")] == [running["request_id"]]
    g.handle("tenants", b"a", tenant("a", disabled=True), NOW + 1)
    out = outputs(g)
    errors = [o.record for o in out if o.event == "RequestError"]
    assert [(e["request_id"], e["status_code"], e["code"]) for e in errors] == [
        (queued["request_id"], 403, "tenant_disabled")]
    done = [o.record for o in out if o.event == "RequestCompleted"]
    assert [(d["request_id"], d["status"]) for d in done] == [(queued["request_id"], "cancelled")]
    cancels = [o for o in out if o.event == "RequestCancelled"]
    assert [c.record["request_id"] for c in cancels] == [running["request_id"]]
    assert cancels[0].topic == "cancellations" and len(g.queue) == 0
    late = request("a")
    g.on_request(late, NOW + 2)
    err = outputs(g, "RequestError")
    assert [(e.record["request_id"], e.record["status_code"]) for e in err] == [(late["request_id"], 403)]
    assert late["request_id"] not in g.records and g.ledger.in_flight("a")[1] == 1  # only the running one
    g.handle("tenants", b"a", tenant("a", disabled=False), NOW + 3)
    g.on_request(request("a"), NOW + 3)
    assert outputs(g, "RequestError") == []  # enabled again: admitted
