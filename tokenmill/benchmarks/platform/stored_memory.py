"""`tokenmill bench stored-memory`: what one tenant's stored responses cost an ingress process in memory.

    tokenmill bench stored-memory [--responses 100000] [--cache-mb 64] [--json PATH]

Every ingress follows the compacted `responses` topic into a view (ingress/api/responses/store.py) that
keeps a small index entry per stored response and whole records only up to its cache bound
(`TOKENMILL_RESPONSE_CACHE_BYTES`), so its memory should be that bound plus the index, whatever a tenant
stores. A tenant is held to 100,000 responses and 256 MiB (`TOKENMILL_STORED_RESPONSES_PER_TENANT`,
`..._BYTES_PER_TENANT`), each record under 900,000 bytes, so the two worst shapes one tenant can reach are
measured: as many responses as allowed (each of the largest size the byte cap then leaves) and records of
the largest size (as many as the byte cap allows).

The view counts its index (an entry per stored response of every tenant, ~372 B, counted at
INDEX_ENTRY_BYTES) against the bound too, evicting records to make room for it: it holds more than the
bound only once the index alone fills it.

The records are applied to the view as its follower applies what it reads back (with their topic
position, so they can be evicted), in this process; the memory is Python's own count of what the view
holds once they are all in (tracemalloc, after a collection), not the process's RSS, which the
allocator does not give back at once.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import tracemalloc
from typing import cast

from ingress.api.responses.store import ResponseStore, record_bytes, stored_bytes_per_tenant
from ingress.api.responses.turn import max_stored_response_bytes
from schemas.records import StoredResponse
from tokenmill.benchmarks.harness.report import write_json


def stored_record(i: int, text_bytes: int, now: float) -> dict:
    """A completed stored response whose text fields weigh `text_bytes` (distinct per record)."""
    head = f"{i:012d}"
    body = (head * (text_bytes // (2 * len(head)) + 1))[: text_bytes // 2]
    return {"event_id": f"e{i}", "request_id": f"{i:032x}", "schema_version": 1, "timestamp_ms": int(now * 1000),
            "response_id": f"resp_{i:032x}", "tenant_id": "heavy", "deleted": False, "model": "tiny",
            "created_at": int(now), "status": "completed", "incomplete_reason": None,
            "previous_response_id": None, "instructions": None,
            "input_items_json": json.dumps([{"role": "user", "content": body}]), "output_text": body,
            "metadata_json": "{}", "max_output_tokens": None, "temperature": None, "top_p": None,
            "input_tokens": 100, "output_tokens": 100, "cached_tokens": 0, "background": False,
            "reply_partition": 0, "created_at_ms": int(now * 1000), "error_message": None, "text_json": "{}",
            "output_calls_json": "[]", "tools_json": "[]"}


def measure(responses: int, text_bytes: int, cache_bytes: int) -> dict:
    """Apply `responses` records of `text_bytes` each to a fresh view; what it holds afterwards."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    store = ResponseStore(cache_bytes=cache_bytes)
    now = time.time()
    logical = 0
    began = time.perf_counter()
    for i in range(responses):
        record = stored_record(i, text_bytes, now)
        logical += record_bytes(record)
        # short of a StoredResponse by its tool_choice_json, as every measurement so far was made
        store.apply(cast(StoredResponse, record), at=(i % 12, i))
    elapsed = time.perf_counter() - began
    del record
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    cached = store.cached_records
    return {"responses": responses, "record_bytes": logical // responses, "stored_bytes": logical,
            "cache_bound_bytes": cache_bytes, "cached_records": cached, "cached_logical_bytes": store.cached_bytes,
            "held_bytes": held, "held_per_response_bytes": held / responses,
            "beyond_bound_per_response_bytes": max(0, held - cache_bytes) / responses,
            "held_over_bound": held / cache_bytes, "apply_per_s": responses / elapsed}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="tokenmill bench stored-memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=int, default=100_000, help="the count cap's shape: this many responses")
    ap.add_argument("--cache-mb", type=float, default=None,
                    help="the view's cache bound (default: TOKENMILL_RESPONSE_CACHE_BYTES, 64 MiB)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from ingress.api.responses.store import view_cache_bytes

    cache = int(args.cache_mb * 2**20) if args.cache_mb is not None else view_cache_bytes()
    budget = stored_bytes_per_tenant()
    largest = max_stored_response_bytes()
    shapes = {"most responses": (args.responses, budget // args.responses - 512),
              "largest records": (budget // largest, largest - 512)}
    print(f"tokenmill bench stored-memory: one tenant's caps ({budget / 2**20:.0f} MiB), view cache bound "
          f"{cache / 2**20:.0f} MiB, pid {os.getpid()}", flush=True)
    rows = {name: measure(n, size, cache) for name, (n, size) in shapes.items()}
    print(f"{'shape':<17}{'responses':>10}{'record B':>10}{'stored MiB':>12}{'held MiB':>10}{'held/bound':>11}"
          f"{'beyond bound B/response':>25}{'cached':>8}")
    for name, r in rows.items():
        print(f"{name:<17}{r['responses']:>10}{r['record_bytes']:>10}{r['stored_bytes'] / 2**20:>12.1f}"
              f"{r['held_bytes'] / 2**20:>10.1f}{r['held_over_bound']:>11.2f}"
              f"{r['beyond_bound_per_response_bytes']:>25.0f}"
              f"{r['cached_records']:>8}")
    result = {"cache_bound_bytes": cache, "tenant_bytes_cap": budget, "shapes": rows}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
