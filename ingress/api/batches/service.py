"""Batch operations shared by the CLI and the HTTP API: submit, refresh, finalize, cancel."""
from __future__ import annotations

import json

import threading
import time
from typing import Any, Callable

from confluent_kafka import Producer

from infra.kafka import clients as kafka_clients
from ingress.api.batches import ids
from ingress.api.batches.collect import BatchFold, ResultReader
from infra.config import default_max_tokens as configured_max_tokens
from ingress.api.batches.parse import ModelLike, parse_file
from ingress.api.batches.store import BatchStore, jsonl
from ingress.api.batches.submit import build_request, cancel_events, publish
from schemas import topics

DEFAULT_WINDOW = "24h"
# OpenAI's limit per batch; it also bounds a manifest and the events one submit puts on `requests`.
MAX_BATCH_LINES = 50_000
# Batches of one tenant not yet ended; each holds files and a share of the queue.
MAX_OPEN_BATCHES = 50
# After a cancel, requests that have not reported an end this long later are counted as cancelled.
CANCEL_GRACE_S = 60.0


class BatchRefused(Exception):
    """The whole batch cannot be accepted (not a per-line problem)."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def now_ms() -> int:
    return int(time.time() * 1000)


class BatchService:
    def __init__(self, store: BatchStore | None = None, models: Callable[[str], ModelLike | None] | None = None,
                 default_max_tokens: int | None = None, producer: Producer | None = None,
                 adapters: Callable[[str, str], Any] | None = None):
        """adapters(tenant_id, model id): the tenant's LoRA adapter's manifest a line's model id names, or None."""
        self.store = store or BatchStore()
        self.models = models or (lambda name: None)
        self.adapters = adapters
        self.default_max_tokens = default_max_tokens if default_max_tokens is not None else configured_max_tokens()
        self._producer = producer
        self._folds: dict[str, tuple[BatchFold, ResultReader, threading.Lock]] = {}
        self._folds_lock = threading.Lock()
        # Per tenant: what a submit checks (the batch's idempotency, the open-batch count) is the
        # tenant's own, and one tenant's 50,000-line file must not hold up everyone else's submit.
        self._submit_locks: dict[str, threading.Lock] = {}
        self._submit_locks_lock = threading.Lock()

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(kafka_clients.producer_config("batch-service"))
        return self._producer

    # --- submit ---
    def _submit_lock_of(self, tenant_id: str) -> threading.Lock:
        with self._submit_locks_lock:
            return self._submit_locks.setdefault(tenant_id, threading.Lock())

    def submit(self, content: bytes, tenant: dict[str, Any], api_key_id: str | None, *,
               model_map: dict[str, str] | None = None, endpoint: str | None = None,
               completion_window: str = DEFAULT_WINDOW, input_file_id: str | None = None,
               input_name: str | None = None, metadata: dict[str, str] | None = None) -> tuple[dict[str, Any], bool]:
        """Validate and publish a file; returns (manifest, newly published?). Idempotent per tenant + file."""
        window_s = ids.parse_window(completion_window)
        if "batch" not in (tenant.get("allowed_priorities") or []):
            raise BatchRefused(403, "Your plan does not allow priority 'batch'.", "priority_not_allowed")
        lines = sum(1 for line in content.splitlines() if line.strip())
        if lines > MAX_BATCH_LINES:
            raise BatchRefused(400, f"A batch may hold at most {MAX_BATCH_LINES} requests; this file has {lines}.",
                               "too_many_requests")
        bid = ids.batch_id(tenant["tenant_id"], content, model_map)
        with self._submit_lock_of(tenant["tenant_id"]):
            existing = self.store.load(bid)
            if existing is not None and existing["state"] == "published":
                return existing, False
            open_batches = [m for m in self.store.list_batches(tenant["tenant_id"]) if m.get("final") is None]
            if existing is None and len(open_batches) >= MAX_OPEN_BATCHES:
                raise BatchRefused(429, f"This tenant already has {len(open_batches)} batches in progress (at most "
                                        f"{MAX_OPEN_BATCHES}); wait for one to end or cancel one.",
                                   "too_many_open_batches")
            parsed = parse_file(content, self.models, tenant=tenant, model_map=model_map, endpoint=endpoint,
                                default_max_tokens=self.default_max_tokens, adapters=self.adapters)
            created = existing["created_at_ms"] if existing else now_ms()
            deadline = created + int(window_s * 1000)
            partition = ids.result_partition(bid)
            records = [build_request(line, batch_id=bid, tenant=tenant, api_key_id=api_key_id,
                                     reply_partition=partition, arrived_at_ms=created, deadline_ms=deadline)
                       for line in parsed.lines]
            manifest = {
                "batch_id": bid, "tenant_id": tenant["tenant_id"], "api_key_id": api_key_id,
                "created_at_ms": created, "deadline_ms": deadline, "completion_window": completion_window,
                "endpoint": endpoint or _common_endpoint(parsed.lines), "input_file_id": input_file_id,
                "input_name": input_name, "input_bytes": len(content), "metadata": metadata or {},
                "model_map": model_map or {}, "reply_topic": topics.BATCH_RESULTS.name, "reply_partition": partition,
                "state": "publishing", "published_at_ms": None, "total_lines": parsed.total_lines,
                "invalid": len(parsed.errors), "cancel_requested_at_ms": None, "cancel_forced_at_ms": None,
                "final": None,
                "requests": [{"line": line.line, "custom_id": line.custom_id, "request_id": rec["request_id"],
                              "chat": line.chat, "model": line.model, "n": line.n,
                              "prompt_tokens": len(line.prompt_token_ids),
                              "tools": json.loads(rec.get("response_format") or "{}").get("type") == "tool_calls"}
                             for line, rec in zip(parsed.lines, records)],
            }
            self.store.save(manifest)
            self.store.write_errors(bid, [e.as_json() for e in parsed.errors])
            if records:
                publish(records, self.producer)
            manifest = self.store.update(bid, state="published", published_at_ms=now_ms())
            return manifest, True

    # --- results ---
    def _fold_for(self, manifest: dict[str, Any], cached: bool) -> tuple[BatchFold, ResultReader, threading.Lock]:
        if not cached:
            fold = BatchFold(manifest)
            return fold, ResultReader(fold), threading.Lock()
        with self._folds_lock:
            held = self._folds.get(manifest["batch_id"])
            if held is None:
                fold = BatchFold(manifest)
                held = (fold, ResultReader(fold), threading.Lock())
                self._folds[manifest["batch_id"]] = held
            return held

    def refresh(self, batch_id: str, cached: bool = True) -> tuple[dict[str, Any], BatchFold | None]:
        """The manifest and a fold brought up to date with Kafka (None once the batch is finalized)."""
        manifest = self.store.load(batch_id)
        if manifest is None:
            raise KeyError(batch_id)
        if manifest.get("final") is not None:
            return manifest, None
        fold, reader, lock = self._fold_for(manifest, cached)
        with lock:
            fold.manifest.update({k: manifest[k] for k in ("cancel_requested_at_ms", "cancel_forced_at_ms")})
            cancelling = manifest.get("cancel_requested_at_ms") is not None
            if manifest["state"] == "published" and fold.entries:
                reader.read(include_usage=cancelling)
            if cancelling and not fold.done() and manifest.get("cancel_forced_at_ms") is None \
                    and now_ms() - manifest["cancel_requested_at_ms"] > CANCEL_GRACE_S * 1000:
                manifest = self.store.update(batch_id, cancel_forced_at_ms=now_ms())
                fold.manifest["cancel_forced_at_ms"] = manifest["cancel_forced_at_ms"]
        return manifest, fold

    @staticmethod
    def status(manifest: dict[str, Any], fold: BatchFold | None) -> tuple[str, dict[str, int]]:
        final = manifest.get("final")
        if final is not None:
            return final["status"], final["counts"]
        assert fold is not None
        now = now_ms()
        counts = fold.counts(now)
        if manifest["state"] != "published":
            return "validating", counts
        if not fold.entries:
            return "failed", counts
        if not fold.done(now):
            return ("cancelling" if manifest.get("cancel_requested_at_ms") else "in_progress"), counts
        if manifest.get("cancel_requested_at_ms"):
            return "cancelled", counts
        if counts["expired"]:
            return "expired", counts
        return "completed", counts

    def finalize_if_done(self, batch_id: str, cached: bool = True) -> tuple[dict[str, Any], BatchFold | None]:
        """Refresh; once every request has ended, write the output and error files and freeze the result.

        Returns the manifest and the fold (None once finalized)."""
        manifest, fold = self.refresh(batch_id, cached)
        if fold is None:
            return manifest, None
        status, counts = self.status(manifest, fold)
        if status in ("in_progress", "cancelling", "validating"):
            return manifest, fold
        now = now_ms()
        outputs = fold.output_rows()
        errors = fold.error_rows(self.store.read_errors(batch_id), now)
        tenant_id = manifest["tenant_id"]
        output_id = error_id = None
        if outputs:
            output_id = ids.file_id("output", batch_id)
            self.store.put_file(tenant_id, f"{batch_id}_output.jsonl", "batch_output", jsonl(outputs), output_id)
        if errors:
            error_id = ids.file_id("errors", batch_id)
            self.store.put_file(tenant_id, f"{batch_id}_errors.jsonl", "batch_output", jsonl(errors), error_id)
        final = {"status": status, "at_ms": now, "counts": counts, "output_file_id": output_id,
                 "error_file_id": error_id}
        manifest = self.store.update(batch_id, final=final)
        with self._folds_lock:
            self._folds.pop(batch_id, None)
        return manifest, None

    def result_rows(self, batch_id: str, cached: bool = False) -> tuple[dict[str, Any], list[dict], list[dict], str,
                                                                        dict[str, int]]:
        """(manifest, output rows, error rows, status, counts): final if the batch is done, else so far."""
        manifest, fold = self.finalize_if_done(batch_id, cached)
        final = manifest.get("final")
        if final is not None:
            outputs = _read_rows(self.store, final["output_file_id"])
            errors = _read_rows(self.store, final["error_file_id"])
            return manifest, outputs, errors, final["status"], final["counts"]
        assert fold is not None  # not final yet: the refresh folded its events
        status, counts = self.status(manifest, fold)
        errors = fold.error_rows(self.store.read_errors(batch_id), now_ms())
        return manifest, fold.output_rows(), errors, status, counts

    # --- cancel ---
    def cancel(self, batch_id: str, cached: bool = True) -> tuple[dict[str, Any], int]:
        """Publish RequestCancelled for every request that has not ended; returns (manifest, cancelled)."""
        manifest, fold = self.refresh(batch_id, cached)
        if fold is None:  # already finalized
            return manifest, 0
        pending = fold.unfinished()
        if manifest.get("cancel_requested_at_ms") is None:
            manifest = self.store.update(batch_id, cancel_requested_at_ms=now_ms())
        sent = cancel_events(manifest["tenant_id"], pending, self.producer) if pending else 0
        return manifest, sent

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(10)


def _common_endpoint(lines) -> str | None:
    kinds = {line.chat for line in lines}
    if len(kinds) != 1:
        return None
    return "/v1/chat/completions" if kinds.pop() else "/v1/completions"


def _read_rows(store: BatchStore, file_id: str | None) -> list[dict[str, Any]]:
    import json

    if file_id is None:
        return []
    return [json.loads(line) for line in store.file_content(file_id).splitlines() if line.strip()]
