"""What bounds a tenant's lookups without Kafka (issue 33, item 1): a read counts one request against the
request rate (and nothing else), per-tenant and per-process slot caps refuse at once with a 429, and
concurrent lookups share one coalesced probe of the topic's ends."""
from __future__ import annotations

import asyncio

import pytest

from http_api.openai_errors import APIError
from ingress.kafka.reads import Coalesced, KafkaReads
from ingress.tenancy.admission import EdgeAdmission
from ingress.tenancy.directory import Caller
from ingress.tenancy.read_limits import TenantSlots

UNLIMITED = {"requests_per_minute": 0, "tokens_per_minute": 0, "max_concurrent": 0, "monthly_token_budget": 0}


def caller(tenant_id: str = "acme", **limits) -> Caller:
    return Caller(tenant={"tenant_id": tenant_id, **UNLIMITED, **limits}, key_id="k")


def test_a_read_counts_against_the_request_rate_and_is_refused_past_it():
    edge, who = EdgeAdmission(), caller(requests_per_minute=3)
    edge.release(edge.admit(who, "chat", 0))  # a completion and reads share the one rate
    for _ in range(2):
        edge.meter(who)
    with pytest.raises(APIError) as refused:
        edge.meter(who)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_requests"
    assert int(refused.value.headers["Retry-After"]) >= 1
    with pytest.raises(APIError):
        edge.admit(who, "chat-2", 0)  # the reads were counted: no completion either
    edge.meter(caller("other", requests_per_minute=3))  # another tenant's rate is its own


def test_a_read_takes_no_concurrency_slot_and_needs_no_tokens():
    edge = EdgeAdmission()
    busy = caller(max_concurrent=1, tokens_per_minute=10)
    edge.admit(busy, "running", 10)  # its one slot and all its tokens held by a running request
    for _ in range(5):
        edge.meter(busy)  # it can still read what it has
    assert edge.in_flight("acme") == (10, 1)


def test_slots_are_capped_per_tenant_and_per_process_and_come_back_once():
    slots = TenantSlots("replays", "too_many_replays", per_tenant=2, total=3)
    a1, a2 = slots.take("a"), slots.take("a")
    with pytest.raises(APIError) as refused:
        slots.take("a")
    assert refused.value.status == 429 and refused.value.code == "too_many_replays"
    assert refused.value.headers["Retry-After"] == "1"
    b1 = slots.take("b")  # the victim is not refused for the attacker's slots
    with pytest.raises(APIError):
        slots.take("c")  # the process's cap
    a1.release()
    a1.release()  # given back once only
    assert slots.held("a") == 1
    slots.take("c").release()
    a2.release()
    b1.release()
    assert slots.held("a") == slots.held("b") == 0


def test_concurrent_lookups_share_one_probe_that_began_after_they_arrived():
    async def scenario():
        gate = asyncio.Event()
        started: list[int] = []

        async def probe() -> int:
            started.append(len(started))
            await gate.wait()
            return len(started)

        ends = Coalesced(probe)
        first = asyncio.ensure_future(ends(5))
        await asyncio.sleep(0)  # the first probe is under way
        later = [asyncio.ensure_future(ends(5)) for _ in range(50)]
        await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(first, *later)
        # the first caller got the first probe; the fifty that arrived during it share the second
        return results, ends.probes

    results, probes = asyncio.run(scenario())
    assert probes == 2
    assert results[0] == 1 and set(results[1:]) == {2}


def test_a_caller_that_gives_up_leaves_the_probe_to_the_others():
    async def scenario():
        gate = asyncio.Event()

        async def probe() -> str:
            await gate.wait()
            return "ends"

        ends = Coalesced(probe)
        impatient = asyncio.ensure_future(ends(0.01))
        patient = asyncio.ensure_future(ends(5))
        with pytest.raises(asyncio.TimeoutError):
            await impatient
        gate.set()
        return await patient

    assert asyncio.run(scenario()) == "ends"


def test_lookup_reads_run_on_their_own_bounded_pool():
    import threading

    reads = KafkaReads("lookup-test", threads=2)
    try:
        async def scenario():
            release = threading.Event()
            names: set[str] = set()

            def held_read():
                names.add(threading.current_thread().name)
                release.wait(5)

            held = [asyncio.ensure_future(reads.run(held_read)) for _ in range(6)]
            # the default pool (tokenizing, compiling) is free while every lookup thread is held
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "tokenized"), 2) == "tokenized"
            release.set()
            await asyncio.gather(*held)
            return names

        names = asyncio.run(scenario())
        assert len(names) == 2 and all(n.startswith("kafka-reads") for n in names)
    finally:
        reads.close()
