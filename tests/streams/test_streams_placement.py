"""The gate addresses each release to a worker's `work` partition: where the prompt's prefix is cached, within
the free slots each worker has net of what was already sent its way (no Kafka)."""
from __future__ import annotations

from formats.prefix_hash import pack_keys, summary_keys
from streams.config import StreamsSettings
from streams.credits import PoolCredits
from streams.gate import Gate
from tests.streams.test_streams_gate import MODEL, NOW, advert, outputs, request, settings

BLOCK = 16
SYSTEM_A = list(range(1000, 1160))  # 10 blocks
SYSTEM_B = list(range(2000, 2160))


def worker_advert(worker, free, consumed, partitions, cached=None, ts=NOW, inc=None, total=8) -> dict:
    rec = advert(free, consumed, worker=worker, inc=inc or f"{worker}-1", ts=ts)
    rec.update(total_slots=total, block_size=BLOCK, work_partitions=partitions,
               cached_blocks=None if cached is None else pack_keys(cached))
    return rec


def prompt_of(system, tail):
    return system + [tail, tail + 1, tail + 2]


def with_prompt(rec, tokens, salt):
    rec.update(prompt_token_ids=tokens, cache_salt=salt)
    return rec


def keys(tokens, salt):
    return list(summary_keys(tokens, BLOCK, salt))


def two_workers(gate, cached_on_w1=(), cached_on_w2=(), free=(4, 4), ts=NOW):
    gate.handle("capacity", None, worker_advert("w1", free[0], 0, [0, 1, 2], list(cached_on_w1), ts=ts), ts)
    gate.handle("capacity", None, worker_advert("w2", free[1], 0, [3, 4, 5], list(cached_on_w2), ts=ts), ts)


def released(gate):
    return [(o.record["tenant_id"], o.partition) for o in outputs(gate, "InferenceRequested")]


def test_a_request_goes_to_a_partition_of_the_worker_holding_its_tenants_prefix():
    g = Gate(settings())
    two_workers(g, cached_on_w1=keys(SYSTEM_A, "a"), cached_on_w2=keys(SYSTEM_B, "b"))
    g.on_request(with_prompt(request("b"), prompt_of(SYSTEM_B, 1), "b"), NOW)
    g.on_request(with_prompt(request("a"), prompt_of(SYSTEM_A, 1), "a"), NOW)
    g.step(NOW)
    placed = dict(released(g))
    assert placed["a"] in (0, 1, 2) and placed["b"] in (3, 4, 5)


def test_a_tenants_prefix_cached_elsewhere_is_not_a_hit_for_another_tenant():
    g = Gate(settings())
    # w1 holds tenant a's system prompt; tenant c sends the same text under its own salt
    two_workers(g, cached_on_w1=keys(SYSTEM_A, "a"), free=(4, 3))
    g.on_request(with_prompt(request("c"), prompt_of(SYSTEM_A, 1), "c"), NOW)
    g.step(NOW)
    assert released(g) == [("c", 0)]  # by load: w1 has more free slots, no prefix credit either way
    assert g.placer.index.size("w1") == len(keys(SYSTEM_A, "a"))


def test_requests_sharing_a_new_prefix_follow_the_first_one_before_any_summary_shows_it():
    g = Gate(settings())
    two_workers(g, free=(8, 8))
    for i in range(4):
        g.on_request(with_prompt(request("a"), prompt_of(SYSTEM_A, i), "a"), NOW)
    g.step(NOW)
    workers = {0: "w1", 1: "w1", 2: "w1", 3: "w2", 4: "w2", 5: "w2"}
    assert len({workers[p] for _, p in released(g)}) == 1


def test_a_worker_without_free_slots_is_passed_over_until_its_adverts_show_room():
    g = Gate(settings())
    two_workers(g, cached_on_w1=keys(SYSTEM_A, "a"), free=(2, 6))
    for i in range(5):
        g.on_request(with_prompt(request("a"), prompt_of(SYSTEM_A, i), "a"), NOW)
    g.step(NOW)
    parts = [p for _, p in released(g)]
    assert len(parts) == 5
    assert sum(p in (0, 1, 2) for p in parts) == 2  # w1's two slots; the rest went to w2 despite the cache
    assert g.credits.in_transit(MODEL, "w1") == 2 and g.credits.in_transit(MODEL, "w2") == 3


def test_what_a_worker_took_in_settles_its_own_releases_first():
    c = PoolCredits()
    c.on_advert(worker_advert("w1", 4, 0, [0]))
    c.on_advert(worker_advert("w2", 4, 0, [1]))
    c.on_release(MODEL, "r1", NOW, "w1")
    c.on_release(MODEL, "r2", NOW, "w2")
    c.on_release(MODEL, "r3", NOW, None)
    c.on_advert(worker_advert("w2", 3, 2, [1], ts=NOW + 0.1))  # took two: its own, then the unaddressed one
    assert (c.in_transit(MODEL, "w1"), c.in_transit(MODEL, "w2"), c.in_transit(MODEL)) == (1, 0, 1)


def test_in_transit_survives_a_restore_and_reads_the_old_unaddressed_format():
    c = PoolCredits()
    c.on_advert(worker_advert("w1", 4, 0, [0, 7]))
    c.on_release(MODEL, "r1", NOW, "w1")
    c.on_release(MODEL, "r2", NOW + 1, None)
    again = PoolCredits.from_dict(c.to_dict())
    assert (again.in_transit(MODEL, "w1"), again.in_transit(MODEL)) == (1, 2)
    assert again.live_workers(NOW)[0].work_partitions == (0, 7)
    old = PoolCredits.from_dict({"workers": [], "current": {}, "in_transit": {MODEL: [["r9", NOW]]}})
    assert old.in_transit(MODEL) == 1 and old.in_transit(MODEL, "w1") == 0


def test_one_worker_or_workers_that_report_no_partitions_mean_release_by_key():
    g = Gate(settings())
    g.handle("capacity", None, worker_advert("w1", 4, 0, [0, 1], keys(SYSTEM_A, "a")), NOW)
    g.handle("capacity", None, advert(4, 0, worker="old"), NOW)  # an older worker: no partitions reported
    g.on_request(with_prompt(request("a"), prompt_of(SYSTEM_A, 1), "a"), NOW)
    g.step(NOW)
    assert released(g) == [("a", None)]


def test_least_loaded_placement_ignores_where_the_prefix_is():
    g = Gate(StreamsSettings(topic_prefix="", metrics_port=0, placement="least-loaded"))
    two_workers(g, cached_on_w1=keys(SYSTEM_A, "a"), free=(3, 6))
    g.on_request(with_prompt(request("a"), prompt_of(SYSTEM_A, 1), "a"), NOW)
    g.step(NOW)
    assert released(g)[0][1] in (3, 4, 5)


def test_a_restarted_worker_loses_its_summary():
    g = Gate(settings())
    two_workers(g, cached_on_w1=keys(SYSTEM_A, "a"))
    assert g.placer.index.size("w1") == len(keys(SYSTEM_A, "a"))
    g.handle("capacity", None, worker_advert("w1", 4, 0, [0, 1, 2], inc="w1-2", ts=NOW + 1), NOW + 1)
    assert g.placer.index.size("w1") == 0


ADAPTER_VERSION = "0f" * 32  # a sha-256 in hex, as every adapter version is (schemas.checks)


def with_adapter(rec, name, version=ADAPTER_VERSION):
    rec["adapter"] = {"adapter_id": f"{rec['tenant_id']}/{name}", "name": name, "version": version}
    return rec


def test_a_request_goes_to_the_worker_whose_engine_holds_its_adapter_and_a_new_adapter_stays_on_one_worker():
    g = Gate(settings())
    two_workers(g, free=(6, 8))
    resident = "a/support@" + ADAPTER_VERSION[:12]
    g.handle("capacity", None, {**worker_advert("w1", 6, 0, [0, 1, 2]), "resident_adapters": [resident]}, NOW)
    g.on_request(with_adapter(with_prompt(request("a"), prompt_of(SYSTEM_A, 1), "a"), "support"), NOW)
    for i in range(3):  # an adapter no worker holds yet: the first request's worker is expected to load it
        g.on_request(with_adapter(with_prompt(request("b"), prompt_of(SYSTEM_B, i * 100), "b"), "legal"), NOW)
    g.step(NOW)
    placed = released(g)
    workers = {0: "w1", 1: "w1", 2: "w1", 3: "w2", 4: "w2", 5: "w2"}
    assert [workers[p] for t, p in placed if t == "a"] == ["w1"]  # w2 is freer, but would have to load it
    assert len({workers[p] for t, p in placed if t == "b"}) == 1


def test_an_adapter_requests_prefix_is_hashed_with_the_engines_adapter_salt():
    from formats.prefix_hash import adapter_cache_salt

    g = Gate(settings())
    adapter = "a/support@" + ADAPTER_VERSION[:12]
    # w2 caches tenant a's system prompt under the adapter's salt (as its engine does), w1 under the plain one
    two_workers(g, cached_on_w1=keys(SYSTEM_A, "a"), cached_on_w2=keys(SYSTEM_A, adapter_cache_salt("a", adapter)),
                free=(8, 4))
    g.on_request(with_adapter(with_prompt(request("a"), prompt_of(SYSTEM_A, 1), "a"), "support"), NOW)
    g.on_request(with_prompt(request("a"), prompt_of(SYSTEM_A, 2), "a"), NOW)
    g.step(NOW)
    on_w2 = {o.record.get("adapter") is not None: o.partition in (3, 4, 5) for o in outputs(g, "InferenceRequested")}
    assert on_w2 == {True: True, False: False}  # each follows the prefix its own salt cached
