"""Placement policy: a cached prefix wins over an idle worker, never over a full one; least-loaded ignores caches."""
from __future__ import annotations

from schedulers.placement import Candidate, PlacementPolicy, PlacementReason, place
from formats.prefix_hash import cacheable_blocks, summary_keys

PROMPT = list(range(100))  # 6 cacheable blocks of 16
BLOCKS = cacheable_blocks(len(PROMPT), 16)


def holding(n_blocks: int, salt: str | None = "t1"):
    keys = set(list(summary_keys(PROMPT, 16, salt))[:n_blocks])
    return lambda key: key in keys


def keys(salt="t1"):
    return summary_keys(PROMPT, 16, salt)


def test_the_worker_holding_the_prefix_wins_over_an_idler_one():
    pool = [Candidate("busy-with-cache", 1, 8, holding(6)), Candidate("idle", 8, 8, holding(0))]
    chosen = place(pool, keys(), BLOCKS)
    assert (chosen.worker_id, chosen.reason, chosen.hit_blocks) == ("busy-with-cache", PlacementReason.PREFIX, 6)


def test_a_longer_cached_prefix_beats_a_shorter_one():
    pool = [Candidate("two", 8, 8, holding(2)), Candidate("five", 4, 8, holding(5))]
    assert place(pool, keys(), BLOCKS).worker_id == "five"


def test_a_full_worker_does_not_compete_however_much_it_holds():
    pool = [Candidate("full", 0, 8, holding(6)), Candidate("cold", 3, 8, holding(0))]
    chosen = place(pool, keys(), BLOCKS)
    assert (chosen.worker_id, chosen.reason) == ("cold", PlacementReason.LOAD)


def test_with_no_free_slot_anywhere_the_least_loaded_is_chosen():
    pool = [Candidate("a", -2, 8, holding(6)), Candidate("b", 0, 8, holding(0))]
    chosen = place(pool, keys(), BLOCKS)
    assert (chosen.worker_id, chosen.reason) == ("b", PlacementReason.FULL)


def test_nobody_holding_anything_goes_by_free_slots():
    pool = [Candidate("a", 2, 8, holding(0)), Candidate("b", 5, 8, holding(0))]
    chosen = place(pool, keys(), BLOCKS)
    assert (chosen.worker_id, chosen.reason, chosen.hit_blocks) == ("b", PlacementReason.LOAD, 0)


def test_another_tenants_cache_is_no_hit():
    pool = [Candidate("has-t2", 8, 8, holding(6, salt="t2")), Candidate("other", 7, 8, holding(0))]
    chosen = place(pool, keys("t1"), BLOCKS)
    assert (chosen.worker_id, chosen.hit_blocks) == ("has-t2", 0)  # chosen for its free slots only
    assert chosen.reason is PlacementReason.LOAD


def test_least_loaded_ignores_the_cache():
    pool = [Candidate("cached", 4, 8, holding(6)), Candidate("idle", 8, 8, holding(0))]
    chosen = place(pool, keys(), BLOCKS, PlacementPolicy.LEAST_LOADED)
    assert (chosen.worker_id, chosen.reason) == ("idle", PlacementReason.LOAD)


def test_hashing_stops_at_the_first_block_nobody_holds():
    asked = []

    def counting():
        for key in keys():
            asked.append(key)
            yield key

    pool = [Candidate("a", 8, 8, holding(2)), Candidate("b", 8, 8, holding(1))]
    assert place(pool, counting(), BLOCKS).hit_blocks == 2
    assert len(asked) == 3  # blocks 1 and 2 held somewhere, block 3 nowhere: blocks 4-6 never hashed


def test_no_candidates_no_placement():
    assert place([], keys(), BLOCKS) is None


def test_between_equally_free_workers_a_new_prefix_goes_to_the_one_holding_less():
    pool = [Candidate("full-cache", 8, 8, holding(0), cached_blocks=500), Candidate("empty", 8, 8, holding(0))]
    assert place(pool, keys(), BLOCKS).worker_id == "empty"
    assert place(pool, keys(), BLOCKS, PlacementPolicy.LEAST_LOADED).worker_id == "empty"


def test_the_worker_holding_the_requests_adapter_wins_over_an_idler_one_that_would_load_it():
    pool = [Candidate("holds", 2, 8, holding(0), adapters=frozenset({"t1/a@1"})), Candidate("idle", 8, 8, holding(0))]
    chosen = place(pool, keys(), BLOCKS, adapter="t1/a@1")
    assert (chosen.worker_id, chosen.reason, chosen.loads_adapter) == ("holds", PlacementReason.ADAPTER, False)
    base = place(pool, keys(), BLOCKS)  # the base model's request: adapters count for nothing
    assert (base.worker_id, base.reason, base.loads_adapter) == ("idle", PlacementReason.LOAD, False)


def test_an_adapter_nobody_holds_goes_by_load_to_the_worker_holding_fewer_and_is_a_load():
    pool = [Candidate("two", 4, 8, holding(0), adapters=frozenset({"x@1", "y@1"})),
            Candidate("one", 4, 8, holding(0), adapters=frozenset({"z@1"}))]
    chosen = place(pool, keys(), BLOCKS, adapter="t1/new@1")
    assert (chosen.worker_id, chosen.reason, chosen.loads_adapter) == ("one", PlacementReason.LOAD, True)


def test_a_full_worker_holding_the_adapter_does_not_compete():
    pool = [Candidate("holds-full", 0, 8, holding(0), adapters=frozenset({"a@1"})), Candidate("free", 3, 8, holding(0))]
    chosen = place(pool, keys(), BLOCKS, adapter="a@1")
    assert (chosen.worker_id, chosen.loads_adapter) == ("free", True)


def test_least_loaded_ignores_adapters_and_says_when_it_loads_one():
    pool = [Candidate("holds", 2, 8, holding(0), adapters=frozenset({"a@1"})), Candidate("idle", 8, 8, holding(0))]
    chosen = place(pool, keys(), BLOCKS, PlacementPolicy.LEAST_LOADED, adapter="a@1")
    assert (chosen.worker_id, chosen.loads_adapter) == ("idle", True)
