"""Where a request's time to first token goes, hop by hop, from the timestamps Kafka keeps.

Every event carries its producer's CreateTime (milliseconds). For a streamed request:
    client sends                      t0 (client clock)
    ingress produces InferenceRequested   -> `requests`
    streams produces the work item        -> `work`
    the worker produces the first token   -> `replies`
    the client reads the first token  t1 (client clock)
All processes run on this machine, so one clock serves them all. Each hop includes the Kafka
transfer into it (producer linger, broker, consumer fetch) and the work of the process that
produces its end: e.g. "streams" is the `requests` fetch plus the queue's decision.
"""
from __future__ import annotations

import http.client
import json
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from infra import kafka_clients
from schemas import codec, topics

HOPS = ("ingress: HTTP in -> requests", "streams: requests -> work", "worker: work -> first reply",
        "ingress: reply -> client", "total TTFT")


def send_streamed(port: int, api_key: str, model: str, prompt: str, max_tokens: int) -> tuple[str, float, float]:
    """One streamed completion; returns (request id, send time, first-token time), wall clock ms."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True})
    t0 = time.time()
    try:
        conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {api_key}",
                                                         "Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        request_id, first = resp.getheader("x-request-id"), None
        for line in resp:
            if first is None and line.startswith(b"data:") and b'"choices"' in line:
                first = time.time()
            if line.startswith(b"data: [DONE]"):
                break
    finally:
        conn.close()
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return request_id, t0 * 1000, first * 1000


def first_timestamps(request_ids: set[str]) -> dict[tuple[str, str], int]:
    """(topic, request id) -> CreateTime of the first event of that request on requests, work, replies."""
    found: dict[tuple[str, str], int] = {}
    consumer = Consumer(kafka_clients.consumer_config(None, "hop-latency"))
    try:
        for spec in (topics.REQUESTS, topics.WORK, topics.REPLIES):
            consumer.assign([TopicPartition(spec.name, p, OFFSET_BEGINNING) for p in range(spec.partitions)])
            quiet = 0
            while quiet < 2:
                msgs = consumer.consume(500, 1.0)
                quiet = 0 if msgs else quiet + 1
                for msg in msgs:
                    if msg.error() or msg.value() is None:
                        continue
                    try:
                        record = codec.decode(msg.value(), msg.headers()).record
                    except codec.UndecodableEvent:
                        continue
                    ids = [i["request_id"] for i in record.get("items", [])] if spec is topics.REPLIES \
                        else [record.get("request_id")]
                    for rid in ids:
                        if rid in request_ids:
                            found.setdefault((spec.name, rid), msg.timestamp()[1])
    finally:
        consumer.close()
    return found


def breakdown(samples: list[tuple[str, float, float]]) -> dict[str, list[float]]:
    """Per-hop latencies (ms) of the samples whose events were all found."""
    stamps = first_timestamps({rid for rid, _, _ in samples})
    hops: dict[str, list[float]] = {h: [] for h in HOPS}
    for rid, t0, t1 in samples:
        a, b, c = (stamps.get((t, rid)) for t in (topics.REQUESTS.name, topics.WORK.name, topics.REPLIES.name))
        if a is None or b is None or c is None:
            continue
        for hop, value in zip(HOPS, (a - t0, b - a, c - b, t1 - c, t1 - t0)):
            hops[hop].append(value)
    return hops
