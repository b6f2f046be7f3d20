"""What the Kafka fault tests share: long streaming completions in flight, timing how soon the stack
serves a new request, checking that every request was billed once, and what a failure leaves to read."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx

from schemas import topics
from tests.integration.kafka_probe import read_to_end
from tests.support.ledger import ledger_rows

MODEL = "tiny"
# The outer limit while measuring, so that a slow recovery is reported with its time, not as a hang.
PROBE_LIMIT_S = 60.0


class Load:
    """`streams` long streaming completions (seeded, EOS ignored), each recording the tokens and text
    it has received so far. The same tag gives the same prompts and seeds, so the same text."""

    def __init__(self, stack, tag: str, streams: int = 6, tokens: int = 600):
        self.stack = stack
        self.streams = streams
        self.tokens = tokens
        self.results: dict[int, dict] = {}
        self.received = [0] * streams
        self.texts: list[list[str]] = [[] for _ in range(streams)]
        self.request_ids: list[str | None] = [None] * streams
        self.threads = [threading.Thread(target=self._stream, args=(i, f"{tag} {i}")) for i in range(streams)]

    def start(self) -> "Load":
        """Start every stream and return once each has its first token (or ended)."""
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 60
        while min(self.received) == 0 and time.monotonic() < deadline and any(t.is_alive() for t in self.threads):
            time.sleep(0.01)
        return self

    def in_flight(self) -> int:
        return sum(1 for n in self.received if n < self.tokens)

    def _stream(self, index: int, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": self.tokens, "stream": True,
                "ignore_eos": True, "seed": index}
        finish, error, request_id = None, None, None
        try:
            with httpx.stream("POST", f"{self.stack.base_url}/completions", json=body, timeout=180,
                              headers={"Authorization": f"Bearer {self.stack.api_key}"}) as r:
                request_id = self.request_ids[index] = r.headers.get("x-request-id")
                if r.status_code != 200:
                    error = (r.status_code, r.read().decode())
                else:
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = ("sse", chunk["error"])
                            continue
                        for choice in chunk["choices"]:
                            self.received[index] += 1
                            self.texts[index].append(choice["text"])
                            finish = choice["finish_reason"] or finish
        except httpx.HTTPError as exc:
            error = ("transport", repr(exc))
        self.results[index] = {"request_id": request_id, "tokens": self.received[index], "finish": finish,
                               "error": error, "text": "".join(self.texts[index])}

    def finish(self) -> list[dict]:
        """Every stream's result, in prompt order, once all ended; each must have ended whole."""
        for t in self.threads:
            t.join(240)
        assert len(self.results) == self.streams
        for r in self.results.values():
            assert r["error"] is None and r["finish"] == "length" and r["tokens"] == self.tokens, r
        return [self.results[i] for i in range(self.streams)]


def _probe(stack, since: float) -> tuple[float, float, str]:
    """One short request; (sent, done) in seconds after `since`, and its outcome."""
    sent = time.monotonic() - since
    try:
        r = httpx.post(f"{stack.base_url}/completions", headers={"Authorization": f"Bearer {stack.api_key}"},
                       json={"model": MODEL, "prompt": "after", "max_tokens": 3, "timeout": 10}, timeout=60)
        outcome = "ok" if r.status_code == 200 else f"{r.status_code} id={r.headers.get('x-request-id')} {r.text[:200]}"
    except httpx.HTTPError as exc:
        outcome = repr(exc)
    return sent, time.monotonic() - since, outcome


def time_to_serve(stack, since: float, limit: float = PROBE_LIMIT_S) -> tuple[float | None, list]:
    """Seconds from `since` (a time.monotonic()) until a new request was first served (None if not
    within `limit`), and every probe's (sent, done, outcome).

    A probe starts every 0.25 s and they run concurrently, so one that hangs (ingress holds a request
    up to its deadline plus a grace period) does not delay the next one."""
    probes = []
    with ThreadPoolExecutor(max_workers=16) as pool:
        pending = set()
        while time.monotonic() - since < limit:
            if len(pending) < 16:
                pending.add(pool.submit(_probe, stack, since))
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            probes += [f.result() for f in done]
            if any(outcome == "ok" for _, _, outcome in probes):
                break
        for f in pending:
            f.cancel()
        probes += [f.result() for f in pending if not f.cancelled()]
    served = [d for _, d, outcome in probes if outcome == "ok"]
    return (min(served) if served else None), sorted(probes)


def leaderless() -> list[str]:
    """Partitions the cluster itself names no leader for."""
    from confluent_kafka.admin import AdminClient

    from infra.kafka import clients as kafka_clients

    meta = AdminClient(kafka_clients.admin_config()).list_topics(timeout=10)
    return sorted(f"{t}[{p}]" for t, tm in meta.topics.items() for p, pm in tm.partitions.items() if pm.leader < 0)


def broker_warnings(*brokers) -> str:
    """The last warnings and errors in each local broker's log."""
    found = []
    for broker in brokers:
        lines = [line[:300] for line in broker.log_file.read_text(errors="replace").splitlines()
                 if " WARN " in line or " ERROR " in line]
        found.append(f"===== broker {broker.node_id} =====\n" + "\n".join(lines[-40:]))
    return "\n".join(found)


def stacks_and_logs(stack) -> str:
    """Every service's threads (faulthandler on SIGUSR1, see tokenmill/cli.py) and log tail: what a
    failed recovery leaves to read."""
    from tests.integration import diagnosis

    log_dir = stack.services["worker"].log_path.parent
    diagnosis.dump_threads(diagnosis.live_services(log_dir), timeout=10)
    tails = []
    for name, service in stack.services.items():
        lines = [line for line in service.log().splitlines() if not line.startswith("%")]
        tails.append(f"===== {name} =====\n" + "\n".join(lines[-80:]))
    return "\n".join(tails)


def assert_billed_once(stack, finished: list[dict]) -> None:
    """Each request is completed on `usage` with every token it streamed, and billed once: one ledger
    row each, with the tokens the client received.

    `usage` may carry a completion twice (a record resent on a fresh client after a stall, see
    infra/kafka/resilient_producer.py); the ledger is keyed by request id, and that is what is billed."""
    streamed = {r["request_id"]: r["tokens"] for r in finished}
    ids = set(streamed)
    assert len(ids) == len(finished) and None not in ids
    rows = ledger_rows(stack.billing_url, ids)
    assert sorted(row["request_id"] for row in rows) == sorted(ids)  # one row each: none twice
    assert {row["request_id"]: row["completion_tokens"] for row in rows} == streamed
    # What the ledger was built from: every request completed on `usage`, each time with every token.
    events = read_to_end(topics.USAGE.name, lambda e: e.record["request_id"] in ids)
    assert {e.record["request_id"] for e in events} == ids
    assert all(e.record["completion_tokens"] == streamed[e.record["request_id"]] for e in events)


def stream_chunks(stack, path: str, body: dict, key: str | None = None):
    """(request id, chunk) for each JSON chunk of a streamed request, as the stack's tenant (or `key`)."""
    with httpx.stream("POST", f"{stack.base_url}{path}", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {key or stack.api_key}"}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                yield request_id, chunk


def stream_completion(stack, body: dict, on_token=None, key: str | None = None):
    """(request id, text, finish reason) of a streamed completion; `on_token(request_id, tokens so far)`."""
    text, tokens, finish, request_id = [], 0, None, None
    for request_id, chunk in stream_chunks(stack, "/completions", body, key):
        for choice in chunk["choices"]:
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
            tokens += 1
            if on_token:
                on_token(request_id, tokens)
    return request_id, "".join(text), finish

def request_trails(log_dir, request_ids, per_request: int = 40) -> str:
    """Where each of these requests was last seen: every line a service logged about it, and every
    event about it on the request path's topics, in topic order. What a request that failed its client
    went through (released where, started, preempted, redelivered, completed) is what a flake leaves
    to read, and the assertion alone does not say."""
    from pathlib import Path

    ids = [r for r in request_ids if r]
    logs = sorted(Path(log_dir).glob("*.log"))
    events: dict[str, list[str]] = {rid: [] for rid in ids}
    for topic in (topics.REQUESTS, topics.WORK, topics.PREEMPTIONS, topics.CAPACITY, topics.CANCELLATIONS,
                  topics.REPLIES, topics.USAGE):
        try:
            for event in read_to_end(topic.name, lambda e: (e.record or {}).get("request_id") in events):
                record = event.record
                detail = record.get("status") or record.get("reason") or record.get("code") or ""
                events[record["request_id"]].append(f"{topic.name}: {event.name} {detail}".rstrip())
        except Exception as exc:  # a diagnostic must not hide the failure it is there to explain
            for found in events.values():
                found.append(f"{topic.name}: not read ({exc})")
    trails = []
    for rid in ids:
        lines = [f"{path.stem}: {line}" for path in logs
                 for line in path.read_text(errors="replace").splitlines() if rid in line]
        seen = _collapsed(events[rid])
        trails.append(f"===== {rid} =====\n" + "\n".join(lines[:per_request] or ["(in no service's log)"])
                      + "\n" + "\n".join(seen or ["(on no topic)"]))
    return "\n".join(trails)


def _collapsed(lines: list[str]) -> list[str]:
    """Runs of the same line (a stream's token events) as one line with its count."""
    out: list[tuple[str, int]] = []
    for line in lines:
        if out and out[-1][0] == line:
            out[-1] = (line, out[-1][1] + 1)
        else:
            out.append((line, 1))
    return [line if n == 1 else f"{line} x{n}" for line, n in out]


def probe_trails(stack, probes: list, first: int = 3) -> str:
    """request_trails for the first probes that failed with an accepted request's id."""
    import re

    ids = [m.group(1) for _, _, outcome in probes if (m := re.search(r"id=([0-9a-f]{32})", outcome))][:first]
    return request_trails(stack.services["worker"].log_path.parent, ids)
