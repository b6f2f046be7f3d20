"""Folding a batch's results back out of Kafka.

`BatchFold` is pure: it applies `ReplyBatch` items and `RequestError`s addressed to
the batch's requests (ignoring other batches sharing the partition), de-duplicating
tokens by index with ingress's own `RequestView`, and `RequestCompleted` events (read
only once a batch is being cancelled, to learn which requests ended without a result).
`ResultReader` feeds it from Kafka, resuming from where it stopped.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from ingress.serving.prompts import CHAT, TEXT
from ingress.serving.request_view import RequestView
from schemas import codec, topics
from schemas.records import ReplyBatch, ReplyItem, RequestCompleted, RequestError

# Results can carry timestamps from another machine's clock: start reading this much earlier.
CLOCK_SKEW_MS = 5 * 60 * 1000
# A request still without an end this long after its deadline is reported expired.
EXPIRY_GRACE_MS = 60 * 1000

COMPLETED, FAILED, CANCELLED, EXPIRED, PENDING = "completed", "failed", "cancelled", "expired", "pending"


@dataclass
class Entry:
    line: int
    custom_id: str
    request_id: str
    chat: bool
    model: str
    n: int
    prompt_tokens: int
    tools: bool = False  # its answer may call tools: read as tool_calls (ingress/serving/tool_calls.py)


@dataclass
class BatchFold:
    manifest: dict[str, Any]
    entries: dict[str, Entry] = field(default_factory=dict)
    views: dict[str, RequestView] = field(default_factory=dict)
    errors: dict[str, RequestError] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)   # request id -> RequestCompleted status
    finished_at_ms: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        for r in self.manifest["requests"]:
            self.entries[r["request_id"]] = Entry(r["line"], r["custom_id"], r["request_id"], r["chat"], r["model"],
                                                  r["n"], r["prompt_tokens"], r.get("tools", False))

    # --- applying events ---
    def apply(self, event: codec.Event, timestamp_ms: int | None = None) -> None:
        stamp = timestamp_ms or event.record.get("timestamp_ms") or 0
        if event.name == "ReplyBatch":
            for item in codec.record_of(event, ReplyBatch)["items"]:
                self.apply_item(item, stamp)
        elif event.name == "RequestError":
            self.apply_error(codec.record_of(event, RequestError), stamp)
        elif event.name == "RequestCompleted":
            completed = codec.record_of(event, RequestCompleted)
            if completed.get("batch_id") == self.manifest["batch_id"]:
                rid = completed["request_id"]
                if rid is not None and rid in self.entries:
                    self.ended.setdefault(rid, completed["status"])

    def apply_item(self, item: ReplyItem, stamp: int) -> None:
        rid = item["request_id"]
        entry = self.entries.get(rid)
        if entry is None:
            return
        view = self.views.get(rid)
        if view is None:
            kind = CHAT if entry.chat else TEXT
            view = kind.view(response_id=kind.id_prefix + rid, model=entry.model, n=entry.n,
                             prompt_tokens=entry.prompt_tokens, created=stamp // 1000,
                             tool_call_prefix=f"call_{rid[:16]}" if entry.tools else None)
            self.views[rid] = view
        was_finished = view.finished
        view.apply(item)
        if view.finished and not was_finished:
            self.finished_at_ms[rid] = stamp

    def apply_error(self, record: RequestError, stamp: int) -> None:
        rid = record["request_id"]
        if rid is None or rid not in self.entries or rid in self.errors:
            return
        view = self.views.get(rid)
        if view is not None and view.finished:
            return
        self.errors[rid] = record
        self.finished_at_ms.setdefault(rid, stamp)

    # --- reading the state ---
    def state(self, rid: str, now_ms: int | None = None) -> str:
        view = self.views.get(rid)
        if view is not None and view.finished:
            return COMPLETED
        if rid in self.errors:
            return FAILED
        status = self.ended.get(rid)
        if status == "cancelled":
            return CANCELLED
        if status in ("failed", "shed"):
            return FAILED
        if now_ms is not None and now_ms > self.manifest["deadline_ms"] + EXPIRY_GRACE_MS:
            return EXPIRED
        if self.manifest.get("cancel_forced_at_ms") is not None:
            return CANCELLED
        return PENDING

    def counts(self, now_ms: int | None = None) -> dict[str, int]:
        counts = {COMPLETED: 0, FAILED: 0, CANCELLED: 0, EXPIRED: 0, PENDING: 0}
        for rid in self.entries:
            counts[self.state(rid, now_ms)] += 1
        invalid = self.manifest.get("invalid", 0)
        return {"total": len(self.entries) + invalid, "valid": len(self.entries), "invalid": invalid,
                "completed": counts[COMPLETED], "failed": counts[FAILED] + invalid, "generation_failed": counts[FAILED],
                "cancelled": counts[CANCELLED], "expired": counts[EXPIRED], "in_progress": counts[PENDING]}

    def done(self, now_ms: int | None = None) -> bool:
        return all(self.state(rid, now_ms) != PENDING for rid in self.entries)

    def unfinished(self) -> list[str]:
        return [rid for rid in self.entries if self.state(rid) == PENDING]

    # --- output files ---
    def output_rows(self) -> list[dict[str, Any]]:
        rows = []
        for entry in sorted(self.entries.values(), key=lambda e: e.line):
            view = self.views.get(entry.request_id)
            if view is not None and view.finished:
                rows.append({"id": f"batch_req_{entry.request_id}", "custom_id": entry.custom_id,
                             "response": {"status_code": 200, "request_id": entry.request_id, "body": view.body()},
                             "error": None})
        return rows

    def error_rows(self, validation_errors: list[dict[str, Any]], now_ms: int | None = None) -> list[dict[str, Any]]:
        keyed: list[tuple[int, dict[str, Any]]] = []
        for err in validation_errors:
            keyed.append((err["line"], {
                "id": f"batch_req_line_{err['line']}", "custom_id": err.get("custom_id"), "response": None,
                "error": {"code": err["code"], "message": err["message"], "param": err.get("param"),
                          "line": err["line"]}}))
        for entry in self.entries.values():
            state = self.state(entry.request_id, now_ms)
            rid = entry.request_id
            if state == FAILED and rid in self.errors:
                e = self.errors[rid]
                keyed.append((entry.line, {
                    "id": f"batch_req_{rid}", "custom_id": entry.custom_id,
                    "response": {"status_code": e["status_code"], "request_id": rid, "body": {"error": {
                        "message": e["message"], "type": e["error_type"], "param": None, "code": e.get("code")}}},
                    "error": None}))
            elif state in (FAILED, CANCELLED, EXPIRED):
                code = {FAILED: "request_failed", CANCELLED: "batch_cancelled", EXPIRED: "batch_expired"}[state]
                message = {FAILED: "The request failed without an error message.",
                           CANCELLED: "The batch was cancelled before this request finished.",
                           EXPIRED: "The request did not finish within the batch's completion window."}[state]
                keyed.append((entry.line, {"id": f"batch_req_{rid}", "custom_id": entry.custom_id, "response": None,
                                           "error": {"code": code, "message": message, "param": None,
                                                     "line": entry.line}}))
        return [row for _, row in sorted(keyed, key=lambda k: k[0])]


class ResultReader:
    """Reads `batch-results` (the batch's partition) and, on demand, `usage`, from where it left off."""

    def __init__(self, fold: BatchFold):
        self.fold = fold
        self.positions: dict[tuple[str, int], int] = {}
        self.undecodable = 0

    def _start(self, topic: str, partition: int) -> int:
        key = (topic, partition)
        if key not in self.positions:
            since = self.fold.manifest["created_at_ms"] - CLOCK_SKEW_MS
            self.positions[key] = topic_reader.first_offset_since(topic, partition, since, "batch-collect")
        return self.positions[key]

    def read(self, include_usage: bool = False, timeout: float = 30.0) -> int:
        """Apply everything up to the current end of the partitions; returns messages read. What a
        read that runs out of time did not reach, the next read starts from."""
        wanted = [(topics.BATCH_RESULTS.name, self.fold.manifest["reply_partition"])]
        if include_usage:
            wanted += [(topics.USAGE.name, p) for p in topic_reader.partitions(topics.USAGE.name, "batch-collect")]
        read = 0
        try:
            for msg in topic_reader.read_to_end({k: self._start(*k) for k in wanted}, "batch-collect", timeout):
                self.positions[(msg.topic(), msg.partition())] = msg.offset() + 1
                read += 1
                results = msg.topic() == topics.BATCH_RESULTS.name
                try:
                    event = codec.decode(msg.value(), msg.headers(), check=True,
                                         expect=("ReplyBatch", "RequestError") if results else ("RequestCompleted",))
                    self.fold.apply(event, msg.timestamp()[1] if msg.timestamp()[1] > 0 else None)
                except Exception as exc:  # never let one record stop a batch's results
                    self.undecodable += 1
                    if results:  # `usage` has consumers of its own that park its bad records
                        reason = str(exc) if isinstance(exc, codec.UndecodableEvent) else \
                            f"unprocessable: {type(exc).__name__}: {exc}"
                        _park(msg, reason)
        except TimeoutError:
            pass
        finally:
            _dead_letters.flush(5)
        return read


_dead_letters = kafka_clients.DeadLetters("batch-collect")
_parked: OrderedDict[tuple[str, int, int], None] = OrderedDict()  # several folds may read one partition
_parked_lock = threading.Lock()


def _park(msg, reason: str) -> None:
    """Dead-letter a bad `batch-results` record once per process, however many batches read it."""
    where = (msg.topic(), msg.partition(), msg.offset())
    with _parked_lock:
        if where in _parked:
            return
        _parked[where] = None
        while len(_parked) > 10000:
            _parked.popitem(last=False)
    _dead_letters.send(msg, reason)
