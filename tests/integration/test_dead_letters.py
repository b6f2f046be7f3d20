"""Bad input on every consumed topic goes to `dead-letters`, and its consumers keep going.

For each topic some service reads, three bad messages are produced back to back on one partition,
against the running stack and its real broker:

- corrupt: random bytes under the topic's own event headers;
- wrong type: a well-encoded event that does not belong on the topic;
- impossible: a well-encoded event of the right type with values no producer writes (a negative
  token count, an infinite weight, an empty request id, ...; see schemas/checks.py).

Every consumer of the topic must park each of them on `dead-letters` with a reason naming what was
wrong (the later ones prove it read on past the earlier ones), stay up, and then still process the
next valid event: after each topic the stack serves a completion end to end. `batch-results` is read
by the batch result reader, which runs here in the test process.
"""
from __future__ import annotations

import copy
import json
import math
import os
import time
import uuid
from typing import Any, Callable

import httpx
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from infra.kafka import clients as kafka_clients
from schemas import checks, codec, topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

STREAMS = "tokenmill-streams"
WORKER = "test-worker-0"


def sample(name: str) -> dict[str, Any]:
    """A valid, plausible record of event `name`, built from its schema."""
    def build(schema):
        if isinstance(schema, list):
            non_null = [s for s in schema if s != "null"]
            return build(non_null[0]) if non_null else None
        if isinstance(schema, dict):
            kind = schema["type"]
            if kind == "record":
                return {f["name"]: build(f["type"]) for f in schema["fields"]}
            if kind == "array":
                return [build(schema["items"])]
            if kind == "map":
                return {"k": build(schema["values"])}
            return build(kind)
        return {"string": "s", "int": 7, "long": 7, "double": 0.5, "boolean": False, "bytes": b"x",
                "null": None}[schema]

    raw = json.loads(codec.VERSIONS[name][codec.latest_version(name)].read_text())
    record = build(raw)
    record.update(event_id=uuid.uuid4().hex, request_id=uuid.uuid4().hex, timestamp_ms=int(time.time() * 1000))
    if name == "RequestError":
        record["status_code"] = 400
    if name == "PreemptRequested":
        record["reason"] = "fairness"
    if name == "StoredResponse":
        record["status"] = "completed"
    if name in ("AdapterManifest", "AdapterChunk"):
        record["version"] = "0f" * 32  # a sha-256 in hex: it names a directory on every worker
    if name == "AdapterManifest":
        record["adapter_id"] = f"{record['tenant_id']}/{record['name']}"
    if name == "InferenceRequested":  # the request's own tenant's adapter, at a possible version
        record["adapter"] = {"adapter_id": f"{record['tenant_id']}/support", "name": "support", "version": "0f" * 32}
    return record


def _set(path: str, value) -> Callable[[dict], None]:
    def mutate(record: dict) -> None:
        *parents, last = path.split(".")
        target = record
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[last] = value
    return mutate


# topic -> (its event, a mutation that makes that event impossible, the consumers that read it)
ConsumerMatch = Callable[[str], bool]
TOPICS: dict[str, tuple[str, Callable[[dict], None], list[tuple[str, ConsumerMatch]]]] = {
    "tenants": ("TenantSnapshot", _set("fairness_weight", math.inf), [
        ("streams", lambda c: c == STREAMS),
        ("ingress tenant view", lambda c: c.startswith("ingress-") and c.endswith("-tenants"))]),
    "requests": ("InferenceRequested", _set("sampling.n", 0), [("streams", lambda c: c == STREAMS)]),
    "work": ("InferenceRequested", _set("prompt_token_ids", [-5]), [("worker", lambda c: c == WORKER)]),
    "capacity": ("CapacityAdvertised", _set("free_slots", -1), [("streams", lambda c: c == STREAMS)]),
    "replies": ("ReplyBatch", _set("items.0.first_token_index", -1),
                [("ingress reply router", lambda c: c == "ingress-replies-0")]),
    "cancellations": ("RequestCancelled", _set("request_id", ""), [
        ("streams", lambda c: c == STREAMS), ("worker", lambda c: c == WORKER)]),
    "preemptions": ("PreemptRequested", _set("reason", "because"), [("worker", lambda c: c == WORKER)]),
    "usage": ("RequestCompleted", _set("completion_tokens", -3), [
        ("streams", lambda c: c == STREAMS), ("billing", lambda c: c.startswith("billing-"))]),
    "quota-state": ("QuotaState", _set("tokens_in_window", -10),
                    [("ingress quota view", lambda c: c.startswith("ingress-") and c.endswith("-quota"))]),
    "ingress-heartbeats": ("IngressHeartbeat", _set("interval_ms", 0),
                           [("worker reply readers", lambda c: c == f"{WORKER}-heartbeats")]),
    "responses": ("StoredResponse", _set("input_tokens", -1),
                  [("ingress response store", lambda c: c.startswith("ingress-") and c.endswith("-responses"))]),
    "adapters": ("AdapterManifest", _set("rank", 0), [
        ("ingress adapter view", lambda c: c.startswith("ingress-") and c.endswith("-adapters")),
        ("worker adapter cache", lambda c: c == f"{WORKER}-adapters")]),
    "batch-results": ("RequestError", _set("status_code", 200), [("batch results", lambda c: c == "batch-collect")]),
}
WRONG_TYPE = {name: ("QuotaState" if name == "ingress-heartbeats" else "IngressHeartbeat") for name in TOPICS}
REASONS = ("corrupt", "does not belong", "impossible")


def test_every_consumed_topic_is_covered():
    consumed = {spec.name for spec in topics.ALL_TOPICS} - {topics.DEAD_LETTERS.name}
    assert consumed == set(TOPICS)


@pytest.mark.parametrize("topic", sorted(TOPICS))
def test_impossible_records_fail_the_checks_and_samples_pass(topic):
    name, make_impossible, _ = TOPICS[topic]
    record = sample(name)
    assert checks.problems(name, record) == []
    bad = copy.deepcopy(record)
    make_impossible(bad)
    assert checks.problems(name, bad), bad
    with pytest.raises(codec.UndecodableEvent, match="impossible"):
        codec.decode(*codec.encode(name, bad), check=True)


def bad_messages(topic: str, key: bytes) -> list[tuple[bytes, list]]:
    name, make_impossible, _ = TOPICS[topic]
    impossible = sample(name)
    make_impossible(impossible)
    if name == "TenantSnapshot":
        impossible["tenant_id"] = key.decode()
    if name == "StoredResponse":
        impossible["response_id"] = key.decode()
    version = str(codec.latest_version(name)).encode()
    return [
        (b"\xff" * 10 + os.urandom(6),  # random bytes that cannot even start a record
         [(codec.EVENT_HEADER, name.encode()), (codec.VERSION_HEADER, version)]),
        codec.encode(WRONG_TYPE[topic], sample(WRONG_TYPE[topic])),
        codec.encode(name, impossible),
    ]


def produce(topic: str, partition: int, key: bytes, messages: list[tuple[bytes, list]]) -> list[int]:
    producer = Producer(kafka_clients.producer_config("dead-letter-test"))
    offsets: list[int] = []

    def delivered(err, msg):
        assert err is None, err
        offsets.append(msg.offset())

    for value, headers in messages:
        producer.produce(topic, key=key, value=value, headers=headers, partition=partition, on_delivery=delivered)
    assert producer.flush(15) == 0
    return sorted(offsets)


def dead_letter_ends() -> list[TopicPartition]:
    c = Consumer(kafka_clients.consumer_config(None, "dead-letter-test-ends"))
    try:
        return [TopicPartition(topics.DEAD_LETTERS.name, p,
                               c.get_watermark_offsets(TopicPartition(topics.DEAD_LETTERS.name, p), timeout=10)[1])
                for p in range(topics.DEAD_LETTERS.partitions)]
    finally:
        c.close()


def read_dead_letters(start: list[TopicPartition], topic: str, partition: int, offsets: list[int],
                      consumers: list[tuple[str, ConsumerMatch]], timeout: float = 30) -> dict:
    """(consumer label, source offset) -> the DeadLetter record, until every one expected is found."""
    want = {(label, offset) for label, _ in consumers for offset in offsets}
    found: dict[tuple[str, int], dict] = {}
    c = Consumer(kafka_clients.consumer_config(None, "dead-letter-test"))
    c.assign(start)
    deadline = time.monotonic() + timeout
    try:
        while want - set(found) and time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is None or msg.error():
                continue
            rec = codec.decode(msg.value(), msg.headers(), expect=("DeadLetter",)).record
            if rec["source_topic"] != topic or rec["source_partition"] != partition \
                    or rec["source_offset"] not in offsets:
                continue
            for label, match in consumers:
                if match(rec["consumer"]):
                    found[(label, rec["source_offset"])] = rec
    finally:
        c.close()
    return found


def completion_works(base_url: str, key: str) -> None:
    r = httpx.post(f"{base_url}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1, r.text


def check_topic(topic: str, partition: int, key: bytes, consumers, after=None) -> list[int]:
    start = dead_letter_ends()
    messages = bad_messages(topic, key)
    offsets = produce(topic, partition, key, messages)
    if after is not None:
        after()
    found = read_dead_letters(start, topic, partition, offsets, consumers)
    missing = [(label, offset) for label, _ in consumers for offset in offsets if (label, offset) not in found]
    assert not missing, f"not dead-lettered on {topic}: {missing}; found {sorted(found)}"
    for label, _ in consumers:
        for offset, reason, (value, _headers) in zip(offsets, REASONS, messages):
            rec = found[(label, offset)]
            assert reason in rec["reason"], (label, reason, rec["reason"])
            assert rec["value"] == value and rec["key"] == key
    return offsets


@pytest.mark.parametrize("topic", sorted(set(TOPICS) - {"batch-results"}))
def test_bad_records_are_dead_lettered_and_consumers_keep_going(stack, topic):
    _, _, consumers = TOPICS[topic]
    partition = 0 if topic == "replies" else 1  # the stack's ingress reads reply partition 0
    key = f"dl-{uuid.uuid4().hex[:12]}".encode()
    check_topic(topic, partition, key, consumers)
    for name, service in stack.services.items():
        assert service.proc.poll() is None, f"{name} died:\n{service.log()[-3000:]}"
    # The next valid event still goes through every consumer on the request path.
    if topic == "tenants":
        new_key = stack.issue_tenant(f"after-{key.decode()}")
        deadline = time.monotonic() + 20
        while httpx.get(f"{stack.base_url}/models", headers={"Authorization": f"Bearer {new_key}"}).status_code != 200:
            assert time.monotonic() < deadline, "ingress stopped applying `tenants`"
            time.sleep(0.1)
        completion_works(stack.base_url, new_key)
    else:
        completion_works(stack.base_url, stack.api_key)


@pytest.mark.parametrize("tenant_id", ["bad id\nwith a newline", "x" * 10_000])
def test_a_snapshot_whose_tenant_id_breaks_the_pattern_is_dead_lettered_by_every_tenants_reader(stack, tenant_id):
    """Well formed in every other way, under its own id as key: only the id is wrong (schemas/checks.py)."""
    _, _, consumers = TOPICS["tenants"]
    start = dead_letter_ends()
    key = tenant_id.encode()
    offsets = produce("tenants", 1, key, [codec.encode("TenantSnapshot", sample("TenantSnapshot") | {
        "tenant_id": tenant_id})])
    found = read_dead_letters(start, "tenants", 1, offsets, consumers)
    assert {label for label, _ in found} == {label for label, _ in consumers}, found
    for rec in found.values():
        assert "impossible" in rec["reason"] and "tenant id" in rec["reason"] and rec["key"] == key


def test_bad_batch_results_are_dead_lettered_and_the_reader_keeps_going(kafka_bootstrap):
    from ingress.api.batches.collect import BatchFold, ResultReader

    partition = 2
    rid = uuid.uuid4().hex
    now = int(time.time() * 1000)
    fold = BatchFold({"batch_id": f"batch-{rid[:8]}", "reply_partition": partition, "created_at_ms": now,
                      "deadline_ms": now + 3_600_000,
                      "requests": [{"request_id": rid, "line": 1, "custom_id": "c1", "chat": False, "model": "tiny",
                                    "n": 1, "prompt_tokens": 3}]})
    reader = ResultReader(fold)
    key = f"dl-{uuid.uuid4().hex[:12]}".encode()

    def then_a_valid_result():
        error = codec.new_event("RequestError", request_id=rid, status_code=400, error_type="invalid_request_error",
                                code="invalid_request", message="bad", retry_after_s=None)
        produce(topics.BATCH_RESULTS.name, partition, key, [codec.encode("RequestError", error)])
        reader.read()

    check_topic(topics.BATCH_RESULTS.name, partition, key, TOPICS["batch-results"][2], after=then_a_valid_result)
    assert reader.undecodable == 3
    assert rid in fold.errors  # the valid event after the bad ones was applied
