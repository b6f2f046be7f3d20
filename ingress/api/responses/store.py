"""Stored Responses API responses: every ingress process's view of the compacted `responses` topic.

A response created with ``store: true`` is one `StoredResponse` event keyed by its id; deleting it writes
the same key again with ``deleted: true`` and no content (compaction then drops the content for good). Any
ingress process follows the topic from the beginning, so any of them can answer ``GET /v1/responses/{id}``
or continue a conversation with ``previous_response_id``, also after the process that created it died.

A stored response expires 30 days after it was created (`topics.RESPONSES_RETENTION_MS`): the view forgets
it then, and the topic's retention deletes it.

A response is visible to the tenant that created it only: for any other tenant it does not exist (404),
never "forbidden", so an id reveals nothing.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from schemas import topics
from schemas.records import StoredResponse
from infra import settings

# A conversation longer than this many stored turns is refused rather than rebuilt (a cycle cannot
# happen, ids are fresh, but a chain this long would not fit any context anyway).
MAX_CHAIN = 1000


# A response in one of these is never written again (finalizer.py writes a background one's, once).
FINAL_STATUSES = ("completed", "incomplete", "cancelled", "failed")


class ConversationNotFound(LookupError):
    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.response_id = response_id


def record_bytes(record: Mapping[str, object]) -> int:
    """What a stored record weighs, counted the same wherever it is applied (its text fields and a fixed
    overhead): what the per-tenant byte cap and the view's memory bound count."""
    return 256 + sum(len(v) for v in record.values() if isinstance(v, str))


# What a whole record held in the view weighs beyond record_bytes (its dict, keys, small values), measured
# by `tokenmill bench stored-memory` (~740 B for a 30-field record): counted against the cache bound, so
# that the bound holds in memory and not only in the records' text.
CACHED_RECORD_OVERHEAD = 1024


def cached_cost(entry_size: int) -> int:
    return entry_size + CACHED_RECORD_OVERHEAD


# What one index entry (`Entry` without its record, its key and its dict slot) weighs, measured by
# `tokenmill bench stored-memory`: the index is counted against the cache bound too, so records are evicted
# to make room for it and the view's memory stays within the bound until the index alone fills it.
INDEX_ENTRY_BYTES = 400


def stored_bytes_per_tenant() -> int:
    return settings.STORED_RESPONSE_BYTES_PER_TENANT.get()


def stored_responses_per_tenant() -> int:
    return settings.STORED_RESPONSES_PER_TENANT.get()


def view_cache_bytes() -> int:
    return settings.RESPONSE_CACHE_BYTES.get()


@dataclass(slots=True)
class Entry:
    """What the view keeps of every stored response: enough to answer who owns it, how big it is, how it
    stands and where the topic holds it; its whole record only while it is in the cache."""
    tenant_id: str
    created_at: float
    size: int
    status: str
    previous_response_id: str | None
    at: tuple[int, int] | None  # (partition, offset) on `responses`; None until the follower has read it
    record: StoredResponse | None
    request_id: str = ""


class Evicted(LookupError):
    """The response exists but its record was evicted from memory: read it back from `at`."""

    def __init__(self, response_id: str, at: tuple[int, int]):
        super().__init__(response_id)
        self.response_id, self.at = response_id, at


class ResponseStore:
    """The newest record per response id, each kept until it expires (created more than `retention_s` ago; the
    topic deletes it then too). Written by the follower's thread and by the event loop (read-your-writes),
    hence the lock.

    Memory is bounded apart from the retention: every response has a small `Entry`, but whole records are
    kept only while they and the index fit in `cache_bytes` (least recently used evicted first; one the
    follower has not read back yet, whose place on the topic is unknown, is kept). An evicted record is
    read back from its offset on the compacted topic when asked for (follower.py). Each tenant's count and bytes
    of stored responses are kept too, for the caps checked before a response is created (`usage`)."""

    SWEEP_EVERY_S = 60.0

    def __init__(self, retention_s: float = topics.RESPONSES_RETENTION_MS / 1000,
                 clock: Callable[[], float] = time.time, cache_bytes: int | None = None) -> None:
        self._entries: dict[str, Entry] = {}
        self._cached: OrderedDict[str, None] = OrderedDict()  # ids whose record is in memory, oldest use first
        self.cached_bytes = 0
        self.cache_bytes = view_cache_bytes() if cache_bytes is None else cache_bytes
        self._usage: dict[str, list[int]] = {}  # tenant -> [count, bytes]
        # background responses not yet final, by request id: what the finalizer (finalizer.py) looks up
        self._unfinished: dict[str, tuple[str, str]] = {}  # request id -> (tenant id, response id)
        self.retention_s, self._clock = retention_s, clock
        self._lock = threading.Lock()
        self._next_sweep = 0.0

    def _expired(self, created_at: float) -> bool:
        return created_at < self._clock() - self.retention_s

    def apply(self, record: StoredResponse, at: tuple[int, int] | None = None) -> None:
        with self._lock:
            response_id = record["response_id"]
            old = self._entries.get(response_id)
            if record["deleted"] or self._expired(record["created_at"]):
                if old is not None:
                    self._drop(response_id, old)
            else:
                # interned: a tenant's thousands of entries share one string of its id and of each status;
                # only a background response's request id is kept (the finalizer looks it up)
                entry = Entry(sys.intern(record["tenant_id"]), record["created_at"], record_bytes(record),
                              sys.intern(record["status"]), record.get("previous_response_id"), at, record,
                              (record.get("request_id") or "") if record.get("background") else "")
                if old is not None:
                    self._drop(response_id, old)
                self._entries[response_id] = entry
                if record.get("background") and record["status"] not in FINAL_STATUSES:
                    self._unfinished[entry.request_id] = (entry.tenant_id, response_id)
                usage = self._usage.setdefault(entry.tenant_id, [0, 0])
                usage[0] += 1
                usage[1] += entry.size
                self._cache(response_id, entry)
            if self._clock() >= self._next_sweep:
                self._forget_expired()

    def _cache(self, response_id: str, entry: Entry) -> None:
        self._cached[response_id] = None
        self.cached_bytes += cached_cost(entry.size)
        self._evict()

    @property
    def cached_records(self) -> int:
        """How many stored responses have their record in memory (the rest are index entries only)."""
        return sum(1 for e in self._entries.values() if e.record is not None)

    @property
    def held_bytes(self) -> int:
        """What the view counts against its bound: the cached records and the whole index."""
        return self.cached_bytes + len(self._entries) * INDEX_ENTRY_BYTES

    def _evict(self) -> None:
        excess = self.held_bytes - self.cache_bytes
        if excess <= 0:
            return
        # Only as far into the oldest-first order as the excess takes (usually one record): a copy of
        # the whole order on every write past the bound made filling the view quadratic.
        victims: list[str] = []
        for response_id in self._cached:
            if excess <= 0:
                break
            entry = self._entries[response_id]
            if entry.at is None:
                continue  # not read back yet: nowhere to read it from
            victims.append(response_id)
            excess -= cached_cost(entry.size)
        for response_id in victims:
            entry = self._entries[response_id]
            entry.record = None
            del self._cached[response_id]
            self.cached_bytes -= cached_cost(entry.size)

    def _drop(self, response_id: str, entry: Entry) -> None:
        del self._entries[response_id]
        self._unfinished.pop(entry.request_id, None)
        if self._cached.pop(response_id, 0) is None:
            self.cached_bytes -= cached_cost(entry.size)
        usage = self._usage[entry.tenant_id]
        usage[0] -= 1
        usage[1] -= entry.size
        if usage[0] <= 0:
            del self._usage[entry.tenant_id]

    def _forget_expired(self) -> None:
        # A whole sweep: partitions are read one after another, so records do not arrive in creation order.
        for response_id in [rid for rid, e in self._entries.items() if self._expired(e.created_at)]:
            self._drop(response_id, self._entries[response_id])
        self._next_sweep = self._clock() + self.SWEEP_EVERY_S

    def __len__(self) -> int:
        return len(self._entries)

    def unfinished(self, request_id: str) -> tuple[str, str] | None:
        """(tenant id, response id) of the background response this request answers, while it is not final."""
        with self._lock:
            return self._unfinished.get(request_id)

    def usage(self, tenant_id: str) -> tuple[int, int]:
        """The tenant's stored responses: (how many, how many bytes)."""
        with self._lock:
            count, size = self._usage.get(tenant_id, (0, 0))
        return count, size

    def _entry(self, tenant_id: str, response_id: str) -> Entry | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.tenant_id != tenant_id or self._expired(entry.created_at):
            return None
        return entry

    def status(self, tenant_id: str, response_id: str) -> str | None:
        with self._lock:
            entry = self._entry(tenant_id, response_id)
            return entry.status if entry is not None else None

    def get(self, tenant_id: str, response_id: str) -> StoredResponse | None:
        """The record, or None when there is none for this tenant; raises Evicted when it is not in memory."""
        with self._lock:
            entry = self._entry(tenant_id, response_id)
            if entry is None:
                return None
            if entry.record is None:
                assert entry.at is not None
                raise Evicted(response_id, entry.at)
            self._cached.move_to_end(response_id)
            return entry.record

    def restore(self, record: StoredResponse, at: tuple[int, int]) -> None:
        """An evicted record read back from `at`: cached again, if it is still the newest of its id."""
        with self._lock:
            entry = self._entries.get(record["response_id"])
            if entry is None or entry.at != at or entry.record is not None:
                return
            entry.record = record
            self._cache(record["response_id"], entry)

    def missing_links(self, tenant_id: str, response_id: str) -> list[Evicted]:
        """The evicted turns of the conversation ending in `response_id` (to read back before `chain`)."""
        missing: list[Evicted] = []
        with self._lock:
            current: str | None = response_id
            for _ in range(MAX_CHAIN):
                entry = self._entry(tenant_id, current) if current is not None else None
                if current is None or entry is None:
                    break
                if entry.record is None and entry.at is not None:
                    missing.append(Evicted(current, entry.at))
                current = entry.previous_response_id
        return missing

    def chain(self, tenant_id: str, response_id: str,
              read_back: dict[str, StoredResponse] | None = None) -> list[StoredResponse]:
        """The conversation ending in `response_id`, oldest turn first; ConversationNotFound names a missing
        (or another tenant's) link. Raises Evicted for a link not in memory nor in `read_back` (records
        read back from the topic, by id)."""
        turns: list[StoredResponse] = []
        current: str | None = response_id
        while current is not None:
            try:
                found = self.get(tenant_id, current)
            except Evicted:
                found = (read_back or {}).get(current)
                if found is None or found["tenant_id"] != tenant_id:
                    raise
            if found is None or len(turns) >= MAX_CHAIN:
                raise ConversationNotFound(current)
            turns.append(found)
            current = found["previous_response_id"]
        turns.reverse()
        return turns


def input_items(record: StoredResponse) -> list[dict[str, Any]]:
    return json.loads(record["input_items_json"])
