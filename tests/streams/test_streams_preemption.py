"""The gate's side of fairness preemption, without Kafka: who it asks to give up a slot, where the
handed-back request goes, who gets the freed slot, and what is billed."""
from __future__ import annotations

from schemas import codec
from streams.gate import Gate
from tests.streams.test_streams_gate import MODEL, NOW, advert, outputs, request, settings, tenant


def preempted(rid, tokens, chars=0, reason="fairness", tenant="a") -> dict:
    rec = codec.new_event("RequestPreempted", request_id=rid, tenant_id=tenant, model=MODEL, worker_id="w1",
                          incarnation="i1", reason=reason, completion_token_ids=tokens, text_chars=chars,
                          started_at_ms=int(NOW * 1000), first_token_at_ms=int(NOW * 1000) + 50)
    return codec.decode(*codec.encode("RequestPreempted", rec)).record


def full_pool_of_a(g: Gate, slots=4, max_tokens=64):
    g.handle("capacity", None, advert(slots, 0), NOW)
    flood = [request("a", max_tokens=max_tokens) for _ in range(slots + 2)]
    for r in flood:
        g.on_request(r, NOW)
    g.step(NOW)
    released = [o.record["request_id"] for o in outputs(g, "InferenceRequested")]
    assert len(released) == slots
    g.handle("capacity", None, advert(0, slots, ts=NOW + 0.1), NOW + 0.1)  # the worker took them all in
    return flood, released


def one_running(g: Gate, prompt=8, max_tokens=64, deadline=None) -> dict:
    """One request of tenant a, released and taken in by the pool's only slot."""
    g.handle("capacity", None, advert(1, 0), NOW)
    r = request("a", max_tokens=max_tokens, prompt=prompt, **({"deadline": deadline} if deadline else {}))
    g.on_request(r, NOW)
    g.step(NOW)
    g.handle("capacity", None, advert(0, 1, ts=NOW + 0.1), NOW + 0.1)
    return r


def test_a_light_tenant_gets_the_slot_preempted_from_the_flood_and_the_victim_resumes_in_its_place():
    g = Gate(settings())
    flood, released = full_pool_of_a(g)
    light = request("b", max_tokens=16)
    g.on_request(light, NOW + 1)
    g.step(NOW + 1)
    asks = outputs(g, "PreemptRequested")
    assert len(asks) == 1
    ask = asks[0].record
    assert ask["reason"] == "fairness" and ask["for_request_id"] == light["request_id"]
    assert ask["request_id"] == released[-1]  # the newest of the flood loses least work
    assert asks[0].topic == "preemptions"
    g.step(NOW + 1.1)
    assert outputs(g, "PreemptRequested") == []  # one ask per waiting request, not one per step

    victim = ask["request_id"]
    g.handle("capacity", b"w1", preempted(victim, [7, 8, 9], chars=5), NOW + 1.2, "RequestPreempted")
    assert victim in g.records and g.records[victim]["resume"]["completion_token_ids"] == [7, 8, 9]
    # the victim is ahead of its tenant's newer queued work again
    queued_a = [r.request_id for r in g.queue.queued() if r.tenant_id == "a"]
    assert queued_a[0] == victim
    g.handle("capacity", None, advert(1, 4, ts=NOW + 1.3), NOW + 1.3)  # the freed slot
    g.step(NOW + 1.3)
    work = [o.record for o in outputs(g, "InferenceRequested")]
    assert [w["request_id"] for w in work] == [light["request_id"]]
    # the flood's request resumes when a slot frees, ahead of the flood's newer requests
    g.on_usage({"request_id": released[0], "prompt_tokens": 8, "completion_tokens": 64, "cached_tokens": 0},
               NOW + 2)
    g.handle("capacity", None, advert(1, 5, ts=NOW + 2), NOW + 2)
    g.step(NOW + 2)
    work = [o.record for o in outputs(g, "InferenceRequested")]
    assert [w["request_id"] for w in work] == [victim]
    assert work[0]["resume"]["completion_token_ids"] == [7, 8, 9] and work[0]["resume"]["text_chars"] == 5
    assert work[0]["resume"]["preemptions"] == 1


def test_no_preemption_when_off_or_when_only_the_flooder_waits():
    g = Gate(settings(preemption=False))
    full_pool_of_a(g)
    g.on_request(request("b"), NOW + 1)
    g.step(NOW + 1)
    assert outputs(g, "PreemptRequested") == []
    g = Gate(settings())
    full_pool_of_a(g)  # two of a's requests wait: work-conserving, nothing to preempt for
    g.step(NOW + 1)
    assert outputs(g, "PreemptRequested") == []


def test_interactive_waiting_behind_batch_preempts_batch_of_the_same_tenant():
    g = Gate(settings())
    g.handle("capacity", None, advert(2, 0), NOW)
    batch = [request("a", priority="batch") for _ in range(3)]
    for r in batch:
        g.on_request(r, NOW)
    g.step(NOW)
    g.handle("capacity", None, advert(0, 2, ts=NOW + 0.1), NOW + 0.1)
    outputs(g)
    g.on_request(request("a", priority="interactive"), NOW + 1)
    g.step(NOW + 1)
    asks = [o.record for o in outputs(g, "PreemptRequested")]
    assert [a["reason"] for a in asks] == ["priority"]


def test_a_hand_back_for_a_request_that_already_ended_changes_nothing():
    g = Gate(settings())
    _, released = full_pool_of_a(g)
    rid = released[0]
    g.on_usage({"request_id": rid, "prompt_tokens": 8, "completion_tokens": 64, "cached_tokens": 0}, NOW + 1)
    g.handle("capacity", b"w1", preempted(rid, [1, 2]), NOW + 1.1, "RequestPreempted")
    assert rid not in g.records and rid not in g.released
    g.handle("capacity", b"w1", preempted("never-seen", [1]), NOW + 1.1, "RequestPreempted")
    assert "never-seen" not in g.records


def test_a_preempted_request_shed_at_its_deadline_is_billed_for_what_it_streamed():
    g = Gate(settings())
    r = one_running(g, deadline=NOW + 5)
    g.handle("capacity", b"w1", preempted(r["request_id"], [4, 5, 6, 7], chars=9), NOW + 1, "RequestPreempted")
    outputs(g)
    g.step(NOW + 6)  # no slot came back before the deadline
    out = outputs(g)
    err = [o.record for o in out if o.event == "RequestError"]
    assert err and err[0]["code"] == "deadline_exceeded"
    done = [o.record for o in out if o.event == "RequestCompleted"]
    assert len(done) == 1 and done[0]["status"] == "shed" and done[0]["completion_tokens"] == 4
    assert g.ledger.in_flight("a") == (0, 0)
    assert g.ledger.usage("a", NOW + 6).used_tokens_in_window == 8 + 4


def test_a_preempted_request_cancelled_while_queued_is_billed_once_for_what_it_streamed():
    g = Gate(settings())
    r = one_running(g)
    g.handle("capacity", b"w1", preempted(r["request_id"], [4, 5]), NOW + 1, "RequestPreempted")
    outputs(g)
    g.on_cancel({"request_id": r["request_id"]}, NOW + 2)
    done = [o.record for o in outputs(g, "RequestCompleted")]
    assert len(done) == 1 and done[0]["status"] == "cancelled" and done[0]["completion_tokens"] == 2
    assert g.ledger.usage("a", NOW + 2).used_tokens_in_window == 8 + 2


def test_vtc_counts_the_preempted_part_once_and_not_the_recomputed_prompt():
    g = Gate(settings())
    r = one_running(g, max_tokens=10)
    g.handle("capacity", b"w1", preempted(r["request_id"], [1, 2, 3]), NOW + 1, "RequestPreempted")
    assert g.queue.counter("a") == 8 + 2 * 3  # settled to what it received
    g.handle("capacity", None, advert(1, 1, ts=NOW + 1.1), NOW + 1.1)
    g.step(NOW + 1.1)
    g.on_usage({"request_id": r["request_id"], "prompt_tokens": 8, "completion_tokens": 10, "cached_tokens": 0},
               NOW + 2)
    assert g.queue.counter("a") == 8 + 2 * 10
    assert g.ledger.usage("a", NOW + 2).used_tokens_in_window == 18  # billed once, in full


def test_a_request_handed_back_after_its_tenant_was_disabled_ends_instead_of_resuming():
    g = Gate(settings())
    r = one_running(g)
    g.handle("tenants", b"a", tenant("a", disabled=True), NOW + 0.5)
    outputs(g)
    g.handle("capacity", b"w1", preempted(r["request_id"], [4, 5]), NOW + 1, "RequestPreempted")
    done = [o.record for o in outputs(g, "RequestCompleted")]
    assert [(d["status"], d["completion_tokens"]) for d in done] == [("cancelled", 2)]
    assert r["request_id"] not in g.records and len(g.queue) == 0
