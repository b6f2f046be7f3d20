"""The stored-responses view: newest record per id, visible to its tenant only, forgotten when it expires."""
from __future__ import annotations

import pytest

from ingress.api.responses.store import ConversationNotFound, ResponseStore

DAY = 86400


def record(response_id: str, created_at: float, tenant_id: str = "a", previous: str | None = None, **fields):
    return {"response_id": response_id, "tenant_id": tenant_id, "created_at": int(created_at), "deleted": False,
            "previous_response_id": previous, "status": "completed", **fields}


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_response_is_visible_only_to_its_tenant_and_gone_once_deleted():
    store = ResponseStore(clock=Clock(1000 * DAY))
    store.apply(record("r1", 1000 * DAY))
    assert store.get("a", "r1")["response_id"] == "r1"
    assert store.get("b", "r1") is None
    store.apply({"response_id": "r1", "tenant_id": "a", "deleted": True})
    assert store.get("a", "r1") is None and len(store) == 0


def test_responses_expire_after_the_retention_and_are_forgotten():
    clock = Clock(1000 * DAY)
    store = ResponseStore(retention_s=30 * DAY, clock=clock)
    store.apply(record("old", clock.now - 31 * DAY))  # read back from the topic after its time
    assert store.get("a", "old") is None and len(store) == 0
    store.apply(record("r2", clock.now + DAY))  # partitions are read one after another: not in creation order
    store.apply(record("r1", clock.now))
    store.apply(record("r1", clock.now, status="cancelled"))
    clock.now += 30 * DAY + 1
    assert store.get("a", "r1") is None and store.get("a", "r2") is not None
    store.apply(record("r3", clock.now))
    assert len(store) == 2  # r1 is dropped from memory, not only hidden


def test_a_conversation_with_an_expired_turn_is_not_found_there():
    clock = Clock(1000 * DAY)
    store = ResponseStore(retention_s=30 * DAY, clock=clock)
    store.apply(record("t1", clock.now))
    store.apply(record("t2", clock.now + 2 * DAY, previous="t1"))
    assert [t["response_id"] for t in store.chain("a", "t2")] == ["t1", "t2"]
    clock.now += 31 * DAY
    with pytest.raises(ConversationNotFound) as missing:
        store.chain("a", "t2")
    assert missing.value.response_id == "t1"
