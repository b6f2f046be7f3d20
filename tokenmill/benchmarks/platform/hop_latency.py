"""Where a request's time to first token goes, hop by hop, from the timestamps the events carry.

Every Kafka record carries its producer's CreateTime (ms, stamped when the producer is handed the
record), and the worker's `RequestCompleted` says when it put the request into its engine
(`started_at_ms`) and when a step produced its first token (`first_token_at_ms`). For a streamed
request:

    client sends                                t0 (client clock)
    ingress produces InferenceRequested         -> `requests`
    streams produces the work item              -> `work`
    the worker adds it to its engine            started_at_ms
    an engine step produces its first token     first_token_at_ms
    the worker produces that token              -> `replies`
    the client reads the first token            t1 (client clock)

All processes run on one machine here, so one clock serves them all. A hop includes the Kafka
transfer into it (producer linger, broker append, consumer fetch) and the work of the process at
its end: "streams" is the `requests` fetch plus the queue's decision (and any wait for credits),
"worker take" is the `work` fetch plus the wait for the worker's loop to come round between engine
steps, "engine" is the wait inside the engine's scheduler plus the prefill.
"""
from __future__ import annotations

import http.client
import json
import time

from infra.kafka import topic_reader
from schemas import codec, topics
from tokenmill.benchmarks.harness.report import percentile

HOPS = ("ingress: HTTP in -> requests", "streams: requests -> work", "worker take: work -> engine",
        "engine: queued + prefill -> first token", "worker: first token -> replies", "ingress: replies -> client",
        "total TTFT")
# A sample's timestamps in the order the hops join them.
_STAMPS = ("sent", "requests", "work", "started", "first_token", "replies", "received")


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
        if request_id is None:
            raise RuntimeError("the answer has no x-request-id: its events cannot be found")
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


def event_timestamps(request_ids: set[str], since_ms: int) -> dict[str, dict[str, int]]:
    """request id -> {"requests", "work", "replies": CreateTime of its first record there;
    "started", "first_token": the worker's own stamps}, from events written since `since_ms`."""
    found: dict[str, dict[str, int]] = {rid: {} for rid in request_ids}
    for spec in (topics.REQUESTS, topics.WORK, topics.REPLIES, topics.USAGE):
        starts = topic_reader.whole_topic(spec.name)
        for msg in topic_reader.read_to_end(starts, "hop-latency", timeout=120, since_ms=since_ms):
            try:
                event = codec.decode(msg.value(), msg.headers())
            except codec.UndecodableEvent:
                continue
            record = event.record
            if spec is topics.USAGE:
                request_id = record.get("request_id")
                stamps = found.get(request_id) if request_id is not None else None
                if stamps is not None and event.name == "RequestCompleted" and record.get("first_token_at_ms"):
                    stamps["started"], stamps["first_token"] = record["started_at_ms"], record["first_token_at_ms"]
                continue
            ids = [i["request_id"] for i in record.get("items", [])] if spec is topics.REPLIES \
                else [record.get("request_id")]
            for rid in ids:
                if rid in found:
                    found[rid].setdefault(spec.name, msg.timestamp()[1])
    return found


def breakdown(samples: list[tuple[str, float, float]], since_ms: int | None = None) -> dict[str, list[float]]:
    """Per-hop latencies (ms) of the samples (request id, sent, first token received; wall ms) whose
    events were all found. Events are read from `since_ms` on (default: a minute before the first send)."""
    if not samples:
        return {h: [] for h in HOPS}
    since = since_ms if since_ms is not None else int(min(t0 for _, t0, _ in samples)) - 60_000
    return join(samples, event_timestamps({rid for rid, _, _ in samples}, since))


def join(samples: list[tuple[str, float, float]], stamps: dict[str, dict[str, int]]) -> dict[str, list[float]]:
    """Each sample's hops from the client's two times and its events' stamps; a sample with any
    stamp missing (an event not found, a request that never completed) is left out."""
    hops: dict[str, list[float]] = {h: [] for h in HOPS}
    for rid, t0, t1 in samples:
        seen = stamps.get(rid, {})
        stamped = [seen.get(k) for k in _STAMPS[1:-1]]
        present = [v for v in stamped if v is not None]
        if len(present) < len(stamped):
            continue
        row = [t0, *present, t1]
        for hop, a, b in zip(HOPS, row, row[1:]):
            hops[hop].append(b - a)
        hops["total TTFT"].append(t1 - t0)
    return hops


def summary(hops: dict[str, list[float]]) -> dict[str, dict]:
    """p50/p90/p99 (ms) and the sample count of each hop."""
    return {hop: {"p50": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99), "n": len(v)}
            for hop, v in hops.items()}


def format_summary(title: str, table: dict[str, dict]) -> str:
    lines = [title, f"{'hop':<42} {'p50':>8} {'p90':>8} {'p99':>8}"]
    for hop, q in table.items():
        lines.append(f"{hop:<42} " + " ".join("-".rjust(8) if q[k] is None else f"{q[k]:>8.1f}"
                                              for k in ("p50", "p90", "p99")))
    return "\n".join(lines)
