"""Turning `RequestCompleted` events into ledger rows, and keeping the minute aggregate exact.

Billing rule (``ran``): a request that reached a GPU is billed exactly the tokens its event reports,
whatever its status: the prompt (once, even if a preemption made it be recomputed) and every
completion token it streamed, so one preempted and then shed at its deadline or cancelled in the
queue pays for the k tokens its client got. A request that never ran (no ``started_at_ms`` and no
completion token: shed or cancelled while queued, refused by its worker before starting) is
recorded with ``billable = 0`` and zero cost and is left out of token totals.
``prompt_tokens`` includes ``cached_tokens`` (OpenAI's convention);
``input_tokens = prompt_tokens - cached_tokens`` are billed at the ``input`` price, cached ones at
``cached_input``, completion tokens at ``output``.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

from billing_pipeline.pricing import PriceBook
from billing_pipeline.store import Store
from schemas.records import RequestCompleted

STATUSES = ("finished", "cancelled", "failed", "shed")
MAX_TOKENS = 2**32 - 1

LEDGER_COLUMNS = (
    "request_id", "tenant_id", "model", "adapter", "status", "finish_reason", "priority", "billable",
    "prompt_tokens", "cached_tokens", "input_tokens", "completion_tokens", "total_tokens", "reserved_tokens",
    "arrived_at", "started_at", "first_token_at", "finished_at", "ttft_ms", "tpot_ms", "queue_ms",
    "worker_id", "api_key_id", "batch_id", "priced", "cost_input_pusd", "cost_cached_pusd", "cost_output_pusd",
    "cost_pusd", "event_id", "event_ts", "kafka_partition", "kafka_offset", "ingested_at", "version",
)


class InvalidUsage(ValueError):
    """A decodable event that cannot be billed (the writer dead-letters it with this reason)."""


def ran(record: Mapping[str, Any]) -> bool:
    """Whether a request reached a GPU, so its tokens are billed: it finished, or started (a preempted
    request keeps its first start), or streamed a completion token. The status alone does not say:
    ``shed`` and ``cancelled`` are both what happens to a queued request, preempted or not."""
    return (record["status"] == "finished" or record.get("started_at_ms") is not None
            or int(record.get("completion_tokens") or 0) > 0)


def ledger_row(record: RequestCompleted, prices: PriceBook, partition: int = -1, offset: int = -1,
               ingested_at_ms: int | None = None) -> list[Any]:
    request_id = record.get("request_id")
    if not request_id:
        raise InvalidUsage("RequestCompleted without request_id")
    if not record.get("tenant_id"):
        raise InvalidUsage("RequestCompleted without tenant_id")
    status = record["status"]
    if status not in STATUSES:
        raise InvalidUsage(f"unknown status {status!r}")
    prompt, completion, cached = record["prompt_tokens"], record["completion_tokens"], record["cached_tokens"]
    if min(prompt, completion, cached) < 0 or max(prompt, completion) > MAX_TOKENS:
        raise InvalidUsage(f"token counts out of range: prompt={prompt} completion={completion} cached={cached}")
    if cached > prompt:
        raise InvalidUsage(f"cached_tokens {cached} > prompt_tokens {prompt}")
    finished = record["finished_at_ms"]
    adapter = record.get("adapter") or ""
    billable = ran(record)
    uncached = prompt - cached
    priced = 1
    costs = [0, 0, 0]
    if billable:
        for i, (kind, n) in enumerate((("input", uncached), ("cached_input", cached), ("output", completion))):
            if n:
                p = prices.price(record["model"], kind, finished, adapter, record["tenant_id"])
                if p is None:
                    priced = 0
                else:
                    costs[i] = n * p
    return [
        request_id, record["tenant_id"], record["model"], adapter, status, record.get("finish_reason") or "",
        record.get("priority") or "", int(billable),
        prompt, cached, uncached, completion, prompt + completion, record.get("reserved_tokens") or 0,
        record["arrived_at_ms"], record.get("started_at_ms"), record.get("first_token_at_ms"), finished,
        record.get("ttft_ms"), record.get("tpot_ms"), record.get("queue_ms"),
        record.get("worker_id") or "", record.get("api_key_id") or "", record.get("batch_id") or "",
        priced, costs[0], costs[1], costs[2], sum(costs),
        record["event_id"], record["timestamp_ms"], partition, offset,
        ingested_at_ms if ingested_at_ms is not None else int(time.time() * 1000), finished,
    ]


def insert_rows(store: Store, rows: list[list[Any]]) -> None:
    store.insert("ledger", rows, LEDGER_COLUMNS)


Bucket = tuple[str, str, str, int]  # tenant, model, adapter ('' = the base model), minute (epoch seconds)


def buckets_of(rows: Iterable[list[Any]]) -> set[Bucket]:
    t, m, a, f = (LEDGER_COLUMNS.index(c) for c in ("tenant_id", "model", "adapter", "finished_at"))
    return {(r[t], r[m], r[a], (r[f] // 60_000) * 60) for r in rows}


def previous_buckets(store: Store, rows: list[list[Any]]) -> set[Bucket]:
    """Buckets where rows for these request ids already sit: a new completion of a request may move
    it to another minute, and the old minute must then be recomputed too."""
    if not rows:
        return set()
    t, r = LEDGER_COLUMNS.index("tenant_id"), LEDGER_COLUMNS.index("request_id")
    tenants = sorted({row[t] for row in rows})
    ids = [row[r] for row in rows]
    found = store.rows(
        "SELECT DISTINCT tenant_id, model, adapter, toUInt32(toStartOfMinute(finished_at)) FROM {db}.ledger "
        "WHERE tenant_id IN {tenants:Array(String)} AND request_id IN {ids:Array(String)}",
        {"tenants": tenants, "ids": ids})
    return {(a, b, c, int(d)) for a, b, c, d in found}


AGG_COLUMNS = ("tenant_id", "model", "adapter", "minute", "requests", "billable_requests", "finished", "cancelled", "failed",
               "shed", "prompt_tokens", "cached_tokens", "input_tokens", "completion_tokens", "total_tokens",
               "cost_pusd", "version")


def refresh_buckets(store: Store, buckets: set[Bucket]) -> int:
    """Recompute these (tenant, model, adapter, minute) buckets from the deduplicated ledger; return how many."""
    if not buckets:
        return 0
    tenants = sorted({b[0] for b in buckets})
    lo = min(b[3] for b in buckets)
    hi = max(b[3] for b in buckets) + 60
    found = store.rows(
        """
        SELECT tenant_id, model, adapter, toUInt32(toStartOfMinute(finished_at)) AS m,
               count(), countIf(billable = 1), countIf(status = 'finished'), countIf(status = 'cancelled'),
               countIf(status = 'failed'), countIf(status = 'shed'),
               sumIf(prompt_tokens, billable = 1), sumIf(cached_tokens, billable = 1),
               sumIf(input_tokens, billable = 1), sumIf(completion_tokens, billable = 1),
               sumIf(total_tokens, billable = 1), sum(toInt128(cost_pusd))
        FROM {db}.ledger FINAL
        WHERE tenant_id IN {tenants:Array(String)}
          AND finished_at >= fromUnixTimestamp64Milli(toInt64({lo:Int64} * 1000), 'UTC')
          AND finished_at < fromUnixTimestamp64Milli(toInt64({hi:Int64} * 1000), 'UTC')
        GROUP BY tenant_id, model, adapter, m
        """, {"tenants": tenants, "lo": lo, "hi": hi})
    version = time.time_ns()
    out = []
    seen = set()
    for row in found:
        key = (row[0], row[1], row[2], int(row[3]))
        if key in buckets:
            seen.add(key)
            out.append([*row[:3], int(row[3]), *row[4:], version])
    for key in buckets - seen:  # a bucket whose only request moved away: now empty
        out.append([key[0], key[1], key[2], key[3], *([0] * 12), version])
    store.insert("usage_minute", out, AGG_COLUMNS)
    return len(out)


def rebuild_aggregate(store: Store) -> int:
    """Recompute every bucket from the ledger (repair tool; also what the tests compare against)."""
    keys = {(a, b, c, int(d)) for a, b, c, d in store.rows(
        "SELECT DISTINCT tenant_id, model, adapter, toUInt32(toStartOfMinute(finished_at)) FROM {db}.ledger")}
    existing = {(a, b, c, int(d)) for a, b, c, d in store.rows(
        "SELECT tenant_id, model, adapter, toUInt32(minute) FROM {db}.usage_minute FINAL")}
    n = 0
    by_tenant: dict[str, set[Bucket]] = {}
    for key in keys | existing:
        by_tenant.setdefault(key[0], set()).add(key)
    for group in by_tenant.values():
        n += refresh_buckets(store, group)
    return n
