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
import logging
import threading
import time
from typing import Any, Callable

from infra import kafka_clients
from infra.compacted_view import CompactedFollower
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
        self.dead_letters = kafka_clients.DeadLetters(client_id)
        self._follower = CompactedFollower(topics.RESPONSES.name, client_id, self._handle,
                                           dead_letters=self.dead_letters)

    async def settled(self, timeout_s: float) -> None:
        """Return once everything on `responses` when called has been applied (or after `timeout_s`: the
        broker is away, and the view answers from what it has)."""
        await self._follower.settled(timeout_s)

    def start(self) -> None:
        self._follower.start()

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

    def stop(self) -> None:
        self._follower.stop()
