"""Stored responses bounded (issue 33, item 4): a record too big for one Kafka message or past its tenant's
caps is refused before anything is generated, and a view whose memory bound evicted records reads them back
from the compacted topic (a real broker) for a lookup and for a conversation."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from confluent_kafka import Producer

from infra.kafka import clients as kafka_clients
from http_api.openai_errors import APIError
from ingress.api.responses.follower import ResponseFollower
from ingress.api.responses.protocol import ResponsesRequest
from ingress.api.responses.store import Evicted, ResponseStore
from ingress.api.responses.turn import OUTPUT_BYTES_PER_TOKEN, check_storable, new_record
from ingress.kafka.reads import KafkaReads
from ingress.tenancy.directory import Caller
from schemas import codec, topics


def caller(tenant_id: str = "acme") -> Caller:
    return Caller(tenant={"tenant_id": tenant_id}, key_id="k")


def body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tiny", "input": "hi", **fields})


def test_a_record_too_big_for_kafka_is_refused_before_generation(monkeypatch):
    monkeypatch.setenv("TOKENMILL_MAX_STORED_RESPONSE_BYTES", "100000")
    store = ResponseStore()
    check_storable(caller(), body(max_output_tokens=100), store, 256)
    # JSON escaping makes an input of quotes twice its size in the record, past what one message carries
    with pytest.raises(APIError) as refused:
        check_storable(caller(), body(input='"' * 60_000, max_output_tokens=16), store, 256)
    assert refused.value.status == 400 and refused.value.code == "response_too_large"
    # room for the answer is counted, up to what the model can generate at all
    with pytest.raises(APIError):
        check_storable(caller(), body(max_output_tokens=100_000 // OUTPUT_BYTES_PER_TOKEN), store, 256)
    check_storable(caller(), body(max_output_tokens=100_000), store, 256, max_model_len=512)
    check_storable(caller(), body(input='"' * 60_000, store=False), store, 256)  # nothing stored: no limit


def test_a_tenant_past_its_stored_responses_caps_is_refused_and_others_are_not(monkeypatch):
    monkeypatch.setenv("TOKENMILL_STORED_RESPONSES_PER_TENANT", "3")
    monkeypatch.setenv("TOKENMILL_STORED_RESPONSE_BYTES_PER_TENANT", "200000")
    store = ResponseStore()
    for i in range(3):
        store.apply(new_record(caller(), body(), uuid.uuid4().hex, f"resp_{i}", 1, -1, 0))
    with pytest.raises(APIError) as refused:
        check_storable(caller(), body(), store, 16)
    assert refused.value.status == 429 and refused.value.code == "stored_responses_limit"
    check_storable(caller("victim"), body(), store, 16)
    check_storable(caller(), body(store=False), store, 16)
    store.apply({"response_id": "resp_0", "tenant_id": "acme", "deleted": True, "created_at": int(time.time())})
    check_storable(caller(), body(), store, 16)  # a deletion frees room
    check_storable(caller("victim"), body(input="x" * 150_000), store, 16)  # 150 kB of 200 kB
    store.apply(new_record(caller("victim"), body(input="x" * 150_000), uuid.uuid4().hex, "resp_v", 1, -1, 0))
    with pytest.raises(APIError) as by_bytes:
        check_storable(caller("victim"), body(input="x" * 60_000), store, 16)  # 210 kB: past it
    assert by_bytes.value.code == "stored_responses_limit"


@pytest.mark.kafka
def test_evicted_records_are_read_back_from_the_topic_for_a_lookup_and_a_conversation(kafka_bootstrap):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    producer = Producer(kafka_clients.producer_config("responses-eviction-test"))
    ids = [f"resp_{uuid.uuid4().hex}" for _ in range(30)]
    previous = None
    for rid in ids:
        record = new_record(caller(tenant), body(input="y" * 5000, previous_response_id=previous),
                            uuid.uuid4().hex, rid, 1, -1, 0)
        kafka_clients.produce_event(producer, topics.RESPONSES.name, rid, "StoredResponse", record)
        previous = rid
    assert producer.flush(15) == 0

    store = ResponseStore(cache_bytes=20_000)  # room for about three of the thirty
    follower = ResponseFollower(f"eviction-test-{uuid.uuid4().hex[:6]}", store)
    reads = KafkaReads("eviction-test", threads=2)
    follower.start()
    try:
        async def scenario():
            await follower.settled(30, reads)
            assert len(store) >= 30 and store.cached_bytes <= 20_000
            with pytest.raises(Evicted):
                store.get(tenant, ids[0])
            first = await follower.record(tenant, ids[0], reads)
            assert first is not None and first["response_id"] == ids[0]
            assert first["input_items_json"] == codec.new_event("StoredResponse", **first)["input_items_json"]
            assert await follower.record("someone-else", ids[0], reads) is None
            turns = await follower.chain(tenant, ids[-1], reads)
            assert [t["response_id"] for t in turns] == ids
            assert store.cached_bytes <= 20_000 + 10_000  # the bound, give or take the record being read back
        asyncio.run(scenario())
    finally:
        follower.stop()
        reads.close()
