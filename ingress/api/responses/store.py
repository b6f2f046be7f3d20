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

import asyncio
import json
import logging
import threading
import time
from typing import Any, Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from infra import kafka_clients, topic_reader
from infra.partition_reader import PartitionReader
from schemas import checks, topics

log = logging.getLogger(__name__)

# A conversation longer than this many stored turns is refused rather than rebuilt (a cycle cannot
# happen, ids are fresh, but a chain this long would not fit any context anyway).
MAX_CHAIN = 1000


class ConversationNotFound(LookupError):
    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    """The newest record per response id, each kept until it expires (created more than `retention_s` ago; the
    topic deletes it then too), so the view is bounded by the retention. Written by the follower's thread and
    by the event loop (read-your-writes), hence the lock."""

    SWEEP_EVERY_S = 60.0

    def __init__(self, retention_s: float = topics.RESPONSES_RETENTION_MS / 1000,
                 clock: Callable[[], float] = time.time) -> None:
        self._records: dict[str, dict[str, Any]] = {}
        self.retention_s, self._clock = retention_s, clock
        self._lock = threading.Lock()
        self._next_sweep = 0.0

    def _expired(self, record: dict[str, Any]) -> bool:
        return record["created_at"] < self._clock() - self.retention_s

    def apply(self, record: dict[str, Any]) -> None:
        with self._lock:
            if record["deleted"] or self._expired(record):
                self._records.pop(record["response_id"], None)
            else:
                self._records[record["response_id"]] = record
            if self._clock() >= self._next_sweep:
                self._forget_expired()

    def _forget_expired(self) -> None:
        # A whole sweep: partitions are read one after another, so records do not arrive in creation order.
        for response_id in [rid for rid, r in self._records.items() if self._expired(r)]:
            del self._records[response_id]
        self._next_sweep = self._clock() + self.SWEEP_EVERY_S

    def __len__(self) -> int:
        return len(self._records)

    def get(self, tenant_id: str, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            record = self._records.get(response_id)
        if record is None or record["tenant_id"] != tenant_id or self._expired(record):
            return None
        return record

    def chain(self, tenant_id: str, response_id: str) -> list[dict[str, Any]]:
        """The conversation ending in `response_id`, oldest turn first; ConversationNotFound names a missing
        (or another tenant's) link."""
        turns: list[dict[str, Any]] = []
        current: str | None = response_id
        while current is not None:
            found = self.get(tenant_id, current)
            if found is None or len(turns) >= MAX_CHAIN:
                raise ConversationNotFound(current)
            turns.append(found)
            current = found["previous_response_id"]
        turns.reverse()
        return turns


def input_items(record: dict[str, Any]) -> list[dict[str, Any]]:
    return json.loads(record["input_items_json"])


class ResponseFollower:
    """Keeps a ResponseStore current by reading `responses` from the beginning, forever (a thread).

    A lookup first waits until the follower has read what the topic held when the lookup began
    (`settled`): a response another ingress stored (and was acknowledged for) a moment ago is then
    found, and an unknown id is answered as soon as the follower is level, not after a fixed wait."""

    def __init__(self, client_id: str, store: ResponseStore | None = None):
        self.store = store or ResponseStore()
        self._client_id = client_id
        self.dead_letters = kafka_clients.DeadLetters(client_id)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._positions: dict[int, int] = {}  # partition -> next offset the follower reads
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._lock = threading.Lock()
        self._probe: Consumer | None = None
        self._probe_lock = threading.Lock()

    def _watermarks(self) -> dict[int, tuple[int, int]]:
        with self._probe_lock:
            if self._probe is None:
                self._probe = Consumer(kafka_clients.consumer_config(None, f"{self._client_id}-ends"))
            name = topics.RESPONSES.name
            partitions = self._probe.list_topics(name, timeout=5).topics[name].partitions
            return {p: self._probe.get_watermark_offsets(TopicPartition(name, p), timeout=5) for p in partitions}

    async def settled(self, timeout_s: float) -> None:
        """Return once everything on `responses` when called has been applied (or after `timeout_s`: the
        broker is away, and the view answers from what it has)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            marks = await asyncio.wait_for(asyncio.to_thread(self._watermarks), timeout_s)
        except Exception as exc:  # noqa: BLE001 - the view still answers, from what it has read
            log.warning("could not read the end of `responses`: %s", exc)
            return
        while True:
            event = asyncio.Event()
            with self._lock:
                behind = [p for p, (low, high) in marks.items() if high > low and self._positions.get(p, -1) < high]
                if not behind:
                    return
                self._waiters.append((loop, event))
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _moved(self, reader: PartitionReader, partitions) -> None:
        name = topics.RESPONSES.name
        with self._lock:
            for p in partitions:
                self._positions[p] = reader.next_offset((name, p))
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="response-follower", daemon=True)
        self._thread.start()

    def _handle(self, msg) -> None:
        if msg.value() is None:
            return  # a tombstone (compaction's own deletes); our deletes are records
        event = self.dead_letters.decode(msg, ("StoredResponse",))
        if event is None:
            return
        problem = checks.response_key_problem(event.record, msg.key())
        if problem:
            self.dead_letters.send(msg, problem)
            return
        self.store.apply(event.record)

    def _run(self) -> None:
        ends = kafka_clients.with_retries(lambda: topic_reader.end_offsets(topics.RESPONSES.name, self._client_id),
                                          "reading `responses` metadata")
        reader = PartitionReader(self._client_id, {(topics.RESPONSES.name, p): OFFSET_BEGINNING for p in ends})
        try:
            while not self._stop.is_set():
                for msg in reader.read(0.1):
                    try:
                        self._handle(msg)
                    except Exception as exc:  # never let one record stop the view
                        self.dead_letters.unprocessable(msg, exc)
                self._moved(reader, ends)
        finally:
            reader.close()
            self.dead_letters.flush()
            with self._probe_lock:
                if self._probe is not None:
                    self._probe.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)
