"""Semantic checks of decoded events: values Avro lets through but no producer of ours writes.

Avro guarantees the types; it does not stop a negative token count, an empty tenant id or an
infinite temperature. A consumer that meets such a record cannot process it meaningfully, so it
dead-letters it like an undecodable one (`infra.kafka.clients.decode_or_dead_letter`). The checks
are deliberately loose: only values that are impossible for every producer are refused, never
values that are merely unusual (e.g. a limit of 0 or -1 means "unlimited" on `tenants`).
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping

INT32_MAX = 2**31 - 1

# What a tenant id may be, wherever one enters (the admin API, the CLI, TenantAdmin, the `tenants` readers).
# The id becomes a Kafka key, a Prometheus label, an HTTP header value and log text, so it holds no control
# characters, spaces, quotes or separators, and is short; it starts with a letter or digit so it never reads
# as a CLI flag or a hidden file. README.md and docs/security.md quote this pattern.
TENANT_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_ID_RULE = "1 to 64 characters of A-Z, a-z, 0-9, '.', '_' or '-', starting with a letter or digit"


def tenant_id_problem(tenant_id: object) -> str | None:
    """Why `tenant_id` is not a valid tenant id (None when it is)."""
    if isinstance(tenant_id, str) and TENANT_ID_PATTERN.fullmatch(tenant_id):
        return None
    shown = repr(tenant_id) if not isinstance(tenant_id, str) or len(tenant_id) <= 80 else repr(tenant_id[:80]) + "..."
    return f"tenant id {shown} is not {TENANT_ID_RULE}"


def _need(problems: list[str], ok: bool, what: str) -> None:
    if not ok:
        problems.append(what)


def _id(problems: list[str], record: dict[str, Any], field: str) -> None:
    _need(problems, isinstance(record.get(field), str) and bool(record[field].strip()), f"{field} is empty")


def _nonneg(problems: list[str], record: dict[str, Any], *fields: str) -> None:
    for field in fields:
        value = record.get(field)
        if value is not None:
            _need(problems, value >= 0, f"{field} is negative ({value})")


def _finite(problems: list[str], record: dict[str, Any], *fields: str) -> None:
    for field in fields:
        value = record.get(field)
        if value is not None:
            _need(problems, math.isfinite(value), f"{field} is not finite ({value})")


# An adapter's version is the sha-256 of its files in hex; it names a directory on every worker.
ADAPTER_VERSION = re.compile(r"[0-9a-f]{64}")


def adapter_ref_problem(ref: Mapping[str, Any], tenant_id: object) -> str | None:
    """Why a request's adapter reference is impossible: a version that is no sha-256 (it becomes a path),
    or an adapter that is not the request's own tenant's <tenant>/<name>."""
    version = ref.get("version")
    if not isinstance(version, str) or not ADAPTER_VERSION.fullmatch(version):
        return f"adapter version {version!r} is not a sha-256 in hex"
    if ref.get("adapter_id") != f"{tenant_id}/{ref.get('name')}":
        return f"adapter_id {ref.get('adapter_id')!r} is not the request tenant's {tenant_id!r}/<name>"
    return None


def _inference_requested(r: dict[str, Any], p: list[str]) -> None:
    for f in ("request_id", "tenant_id", "model", "reply_topic"):
        _id(p, r, f)
    if r.get("adapter") is not None:
        problem = adapter_ref_problem(r["adapter"], r["tenant_id"])
        if problem:
            p.append(problem)
    _nonneg(p, r, "reply_partition", "reserved_tokens", "arrived_at_ms", "deadline_ms")
    _need(p, all(t >= 0 for t in r["prompt_token_ids"]), "prompt_token_ids holds a negative id")
    s = r["sampling"]
    _need(p, s["n"] >= 1, f"sampling.n is {s['n']}")
    _need(p, s["max_tokens"] >= 0, f"sampling.max_tokens is {s['max_tokens']}")
    _finite(p, s, "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    _nonneg(p, s, "temperature", "min_p", "repetition_penalty")
    _need(p, all(t >= 0 for t in s["stop_token_ids"]), "sampling.stop_token_ids holds a negative id")


def _request_completed(r: dict[str, Any], p: list[str]) -> None:
    for f in ("request_id", "tenant_id", "status"):
        _id(p, r, f)
    _nonneg(p, r, "prompt_tokens", "completion_tokens", "cached_tokens", "reserved_tokens", "arrived_at_ms",
            "finished_at_ms")
    _finite(p, r, "ttft_ms", "tpot_ms", "queue_ms")


def _request_cancelled(r: dict[str, Any], p: list[str]) -> None:
    _id(p, r, "request_id")


def _preempt_requested(r: dict[str, Any], p: list[str]) -> None:
    for f in ("request_id", "tenant_id", "model"):
        _id(p, r, f)
    _need(p, r["reason"] in ("fairness", "priority"), f"reason is {r['reason']!r}")


def _request_preempted(r: dict[str, Any], p: list[str]) -> None:
    for f in ("request_id", "tenant_id", "model", "worker_id", "incarnation"):
        _id(p, r, f)
    _nonneg(p, r, "text_chars", "cached_tokens", "timestamp_ms")
    _need(p, all(t >= 0 for t in r["completion_token_ids"]), "completion_token_ids holds a negative id")


def _capacity_advertised(r: dict[str, Any], p: list[str]) -> None:
    for f in ("worker_id", "incarnation", "model"):
        _id(p, r, f)
    _nonneg(p, r, "free_slots", "free_kv_blocks", "total_slots", "total_kv_blocks", "running", "waiting",
            "consumed_total", "timestamp_ms")
    _need(p, r["free_slots"] <= r["total_slots"], f"free_slots {r['free_slots']} > total_slots {r['total_slots']}")
    _need(p, r["block_size"] >= 1, f"block_size is {r['block_size']}")


def _tenant_snapshot(r: dict[str, Any], p: list[str]) -> None:
    # Only here, not on every record naming a tenant: a tenant exists through its snapshot, so one refused
    # here never authenticates and no other record of ours can carry its id.
    problem = tenant_id_problem(r.get("tenant_id"))
    if problem:
        p.append(problem)
    _finite(p, r, "fairness_weight", "default_deadline_s")
    _nonneg(p, r, "default_deadline_s")
    for key in r["api_keys"]:
        _id(p, key, "key_id")
        _id(p, key, "hash")


def _quota_state(r: dict[str, Any], p: list[str]) -> None:
    _id(p, r, "tenant_id")
    _nonneg(p, r, "window_start_ms", "window_ms", "requests_in_window", "tokens_in_window", "in_flight_requests",
            "in_flight_tokens", "month_tokens_used", "timestamp_ms")


def _ingress_heartbeat(r: dict[str, Any], p: list[str]) -> None:
    _id(p, r, "reply_topic")
    _id(p, r, "incarnation")
    _nonneg(p, r, "reply_partition", "timestamp_ms")
    _need(p, r["interval_ms"] > 0, f"interval_ms is {r['interval_ms']}")


def _reply_batch(r: dict[str, Any], p: list[str]) -> None:
    for item in r["items"]:
        _id(p, item, "request_id")
        _nonneg(p, item, "choice_index", "first_token_index")
        _need(p, all(t >= 0 for t in item["token_ids"]), "token_ids holds a negative id")
        if item["usage"] is not None:
            _nonneg(p, item["usage"], "prompt_tokens", "completion_tokens", "cached_tokens")


def _request_error(r: dict[str, Any], p: list[str]) -> None:
    _id(p, r, "request_id")
    _need(p, 400 <= r["status_code"] <= 599, f"status_code is {r['status_code']}")
    _finite(p, r, "retry_after_s")
    _nonneg(p, r, "retry_after_s")


def _stored_response(r: dict[str, Any], p: list[str]) -> None:
    for f in ("response_id", "tenant_id"):
        _id(p, r, f)
    _nonneg(p, r, "input_tokens", "output_tokens", "cached_tokens", "created_at")
    _need(p, r["status"] in ("queued", "in_progress", "completed", "incomplete", "cancelled", "failed"),
          f"status is {r['status']!r}")


def _adapter_manifest(r: dict[str, Any], p: list[str]) -> None:
    for f in ("adapter_id", "tenant_id", "name", "base_model", "version", "weights_sha256"):
        _id(p, r, f)
    _need(p, bool(ADAPTER_VERSION.fullmatch(r["version"])), f"version {r['version']!r} is not a sha-256 in hex")
    _need(p, r["adapter_id"] == f"{r['tenant_id']}/{r['name']}",
          f"adapter_id {r['adapter_id']!r} is not <tenant_id>/<name>")
    _need(p, r["rank"] >= 1, f"rank is {r['rank']}")
    _need(p, r["chunk_count"] >= 1, f"chunk_count is {r['chunk_count']}")
    _nonneg(p, r, "weights_bytes", "created_ms")


def _adapter_chunk(r: dict[str, Any], p: list[str]) -> None:
    for f in ("adapter_id", "version"):
        _id(p, r, f)
    _need(p, bool(ADAPTER_VERSION.fullmatch(r["version"])), f"version {r['version']!r} is not a sha-256 in hex")
    _need(p, 0 <= r["index"] < r["chunk_count"], f"index {r['index']} of {r['chunk_count']} chunks")


CHECKS: dict[str, Callable[[dict[str, Any], list[str]], None]] = {
    "StoredResponse": _stored_response,
    "InferenceRequested": _inference_requested,
    "RequestCompleted": _request_completed,
    "RequestCancelled": _request_cancelled,
    "CapacityAdvertised": _capacity_advertised,
    "PreemptRequested": _preempt_requested,
    "RequestPreempted": _request_preempted,
    "TenantSnapshot": _tenant_snapshot,
    "QuotaState": _quota_state,
    "IngressHeartbeat": _ingress_heartbeat,
    "ReplyBatch": _reply_batch,
    "RequestError": _request_error,
    "AdapterManifest": _adapter_manifest,
    "AdapterChunk": _adapter_chunk,
}


def tenant_key_problem(record: dict[str, Any], key: bytes | str | None) -> str | None:
    """`tenants` is compacted by key: a snapshot filed under another tenant's key would replace
    that tenant's record, so it is refused like any other impossible value."""
    key_text = key.decode(errors="replace") if isinstance(key, bytes) else key
    if record["tenant_id"] != key_text:
        return f"impossible TenantSnapshot: tenant_id {record['tenant_id']!r} under key {key_text!r}"
    return None


def response_key_problem(record: dict[str, Any], key: bytes | None) -> str | None:
    """`responses` is compacted by key: a response filed under another id would replace that one."""
    key_text = key.decode(errors="replace") if isinstance(key, bytes) else key
    if record["response_id"] != key_text:
        return f"impossible StoredResponse: response_id {record['response_id']!r} under key {key_text!r}"
    return None


def adapter_chunk_key(adapter_id: str, version: str, index: int) -> str:
    return f"{adapter_id}@{version}#{index}"


def adapter_key_problem(name: str, record: dict[str, Any], key: bytes | str | None) -> str | None:
    """`adapters` is compacted by key: a manifest or chunk filed under another key would replace that one."""
    key_text = key.decode(errors="replace") if isinstance(key, bytes) else key
    want = (record["adapter_id"] if name == "AdapterManifest"
            else adapter_chunk_key(record["adapter_id"], record["version"], record["index"]))
    if key_text != want:
        return f"impossible {name}: filed under key {key_text!r}, not {want!r}"
    return None


def problems(name: str, record: dict[str, Any]) -> list[str]:
    """What is impossible about this record (empty when nothing is)."""
    check = CHECKS.get(name)
    if check is None:
        return []
    found: list[str] = []
    check(record, found)
    return found
