"""The stored-responses view: newest record per id, visible to its tenant only, forgotten when it expires."""
from __future__ import annotations

import pytest

from ingress.api.responses.store import INDEX_ENTRY_BYTES, ConversationNotFound, Evicted, ResponseStore

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


def test_memory_holds_whole_records_up_to_its_bound_whatever_the_retention(monkeypatch):
    """Issue 33, item 4: the view's memory is bounded apart from the 30 days' retention: past `cache_bytes`
    the least recently used records are evicted (their place on the topic kept, to read them back), and
    a record not yet read back from the topic (no place) is never evicted."""
    clock = Clock(1000 * DAY)
    bound = 1000 * INDEX_ENTRY_BYTES + 100_000  # the index of 1000 responses and ~10 records
    store = ResponseStore(clock=clock, cache_bytes=bound)
    big = "x" * 10_000
    for i in range(1000):  # 10 MB of records into the view
        store.apply(record(f"r{i}", clock.now, output_text=big), at=(0, i))
    assert store.held_bytes <= bound and store.cached_bytes <= 100_000 and len(store) == 1000
    assert store.usage("a") == (1000, sum(10_000 + 256 + len(f"r{i}") + 1 + len("completed") for i in range(1000)))
    with pytest.raises(Evicted) as evicted:
        store.get("a", "r0")
    assert evicted.value.at == (0, 0)
    assert store.get("b", "r0") is None  # another tenant's id is still unknown, never "evicted"
    assert store.get("a", "r999")["output_text"] == big  # the most recent are in memory
    store.restore(record("r0", clock.now, output_text=big), (0, 0))  # read back: cached again
    assert store.get("a", "r0")["response_id"] == "r0" and store.held_bytes <= bound
    store.restore(record("r1", clock.now, output_text="stale"), (0, 12345))  # not its newest place: ignored
    with pytest.raises(Evicted):
        store.get("a", "r1")
    local = ResponseStore(clock=clock, cache_bytes=1)
    local.apply(record("mine", clock.now, output_text=big))  # written here, not read back yet: kept
    assert local.get("a", "mine")["output_text"] == big


def test_a_tenants_stored_count_and_bytes_follow_writes_deletes_and_expiry():
    clock = Clock(1000 * DAY)
    store = ResponseStore(retention_s=30 * DAY, clock=clock)
    store.apply(record("r1", clock.now, output_text="abc"))
    store.apply(record("r1", clock.now, output_text="abcdef"))  # a newer record of the same id replaces it
    store.apply(record("r2", clock.now, tenant_id="b"))
    count, size = store.usage("a")
    assert count == 1 and size == 256 + len("r1") + 1 + len("completed") + 6
    store.apply({"response_id": "r1", "tenant_id": "a", "deleted": True, "created_at": int(clock.now)})
    assert store.usage("a") == (0, 0) and store.usage("b")[0] == 1
    clock.now += 31 * DAY
    store.SWEEP_EVERY_S = 0
    store.apply(record("r3", clock.now, tenant_id="c"))
    assert store.usage("b") == (0, 0)


def test_a_chain_names_the_evicted_links_to_read_back():
    clock = Clock(1000 * DAY)
    store = ResponseStore(clock=clock, cache_bytes=0)
    store.apply(record("t1", clock.now), at=(1, 5))
    store.apply(record("t2", clock.now, previous="t1"), at=(1, 6))
    assert [(e.response_id, e.at) for e in store.missing_links("a", "t2")] == [("t2", (1, 6)), ("t1", (1, 5))]
    with pytest.raises(Evicted):
        store.chain("a", "t2")


def test_the_views_memory_stays_within_its_cache_bound_index_included():
    """The bound holds in memory, not only in the records' text: a small record's dict weighs more than its
    strings, and the index entry every response keeps is counted too, records evicted to make room for it
    (`tokenmill bench stored-memory` measures both at a tenant's caps)."""
    import gc
    import tracemalloc

    from tokenmill.benchmarks.platform.stored_memory import stored_record

    clock = Clock(1000 * DAY)
    bound, count = 2**20, 2000
    assert count * INDEX_ENTRY_BYTES < bound  # the index alone fits: the whole view must
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    store = ResponseStore(clock=clock, cache_bytes=bound)
    for i in range(count):  # 4 MB of ~2 kB records (all of StoredResponse's fields) into a 1 MiB view
        store.apply(stored_record(i, 2000, clock.now), at=(0, i))
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(store) == count and 0 < store.held_bytes <= bound
    assert held <= bound + 64 * 1024, held / bound
