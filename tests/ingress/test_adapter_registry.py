"""Adapter registration (ingress/tenancy/adapter_registry.py) and the catalog every process follows
(lora/adapters.py): each bad input a 400 naming its field with nothing published, and a good one
published as chunks + manifest that resolve for their own tenant only."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lora import adapters
from infra.config import ModelSpec
from schemas import checks
from ingress.tenancy.adapter_registry import AdapterRegistry, AdapterRejected, Registration, decode_weights
from tests.ingress import adapter_files

BASE = "base-model"
BASE_CONFIG = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 512}
OTHER_CONFIG = {**BASE_CONFIG, "hidden_size": 96, "intermediate_size": 192}


class FakePublisher:
    def __init__(self):
        self.published: list = []
        self.deleted: list = []

    def publish(self, manifest, chunks):
        self.published.append((manifest, chunks))

    def delete(self, manifest, chunk_keys=()):
        self.deleted.append((manifest, sorted(chunk_keys)))

    def tombstone(self, keys, aid):
        self.deleted.append((aid, sorted(keys)))


@pytest.fixture
def base_dir(tmp_path):
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(BASE_CONFIG))
    return d


@pytest.fixture
def registry(base_dir):
    return AdapterRegistry({BASE: ModelSpec(BASE, base_dir)}, publisher=FakePublisher(), max_rank=16,
                           max_bytes=2**20)


def registration(name="support", rank=8, targets=("q_proj", "v_proj"), config=None, weights=None, base=BASE,
                 tenant="acme", base_config=BASE_CONFIG, **tensor_options) -> Registration:
    if weights is None:
        weights = adapter_files.safetensors_bytes(
            adapter_files.adapter_tensors(base_config, rank, targets, **tensor_options))
    return Registration(tenant, name, base, config if config is not None else adapter_files.adapter_config(rank, targets),
                        weights)


def rejected(registry, reg, catalog=None) -> AdapterRejected:
    with pytest.raises(AdapterRejected) as info:
        registry.register(reg, catalog or adapters.AdapterCatalog())
    assert registry.publisher.published == []  # nothing stored
    return info.value


def test_a_good_adapter_is_published_as_chunks_then_a_manifest_and_resolves_for_its_tenant_only(registry):
    reg = registration()
    manifest = registry.register(reg, adapters.AdapterCatalog())
    assert manifest["adapter_id"] == "acme/support" and manifest["rank"] == 8
    assert manifest["target_modules"] == ["q_proj", "v_proj"]
    [(published, chunks)] = registry.publisher.published
    catalog = adapters.AdapterCatalog(keep_chunks=True)
    for chunk in chunks:
        catalog.apply_chunk(f"{chunk['adapter_id']}@{chunk['version']}#{chunk['index']}", chunk)
    catalog.apply_manifest(published["adapter_id"], published)
    assert catalog.weights(published) == reg.weights
    assert catalog.resolve("acme", f"{BASE}:support") == published
    assert catalog.resolve("other", f"{BASE}:support") is None  # another tenant: not found
    assert catalog.resolve("acme", "another-base:support") is None
    assert [m["name"] for m in catalog.of_tenant("acme")] == ["support"] and catalog.of_tenant("other") == []


def test_chunks_are_small_and_reassemble_in_order():
    weights = bytes(range(256)) * 5000
    manifest, chunks = adapters.new_records(tenant_id="t", name="n", base_model="b", adapter_config="{}",
                                            weights=weights, rank=4, target_modules=["q_proj"], chunk_bytes=100_000)
    assert len(chunks) == manifest["chunk_count"] == 13
    catalog = adapters.AdapterCatalog(keep_chunks=True)
    for chunk in reversed(chunks):
        catalog.apply_chunk(f"t/n@{manifest['version']}#{chunk['index']}", chunk)
    catalog.apply_manifest("t/n", manifest)
    assert catalog.weights(manifest) == weights
    catalog.apply_chunk(f"t/n@{manifest['version']}#3", None)  # a tombstoned chunk: not whole any more
    assert catalog.weights(manifest) is None
    catalog.apply_manifest("t/n", None)
    assert catalog.get("t/n") is None and catalog.chunks == {}


def test_materialise_writes_a_peft_directory_once(tmp_path):
    manifest, _ = adapters.new_records(tenant_id="t", name="n", base_model="b", adapter_config='{"r": 4}',
                                       weights=b"weights", rank=4, target_modules=["q_proj"])
    path = adapters.materialise(manifest, b"weights", tmp_path)
    assert (path / "adapter_config.json").read_text() == '{"r": 4}'
    assert (path / "adapter_model.safetensors").read_bytes() == b"weights"
    assert adapters.materialise(manifest, b"ignored", tmp_path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == [manifest["version"]]


@pytest.mark.parametrize("name", ["", "Acme", "a:b", "a/b", "-x", "x" * 65, "a b", "a@b"])
def test_a_bad_name_is_refused(registry, name):
    assert rejected(registry, registration(name=name)).param == "name"


def test_an_unserved_base_model_is_refused(registry):
    assert rejected(registry, registration(base="nope")).param == "base_model"


def test_a_name_clash_is_refused(registry):
    catalog = adapters.AdapterCatalog()
    manifest, _ = adapters.new_records(tenant_id="acme", name="support", base_model=BASE, adapter_config="{}",
                                       weights=b"x", rank=8, target_modules=["q_proj"])
    catalog.apply_manifest("acme/support", manifest)
    err = rejected(registry, registration(), catalog)
    assert err.param == "name" and err.code == "adapter_exists"
    registry.register(registration(tenant="other"), catalog)  # the same name in another tenant is its own


def test_a_rank_over_the_limit_is_refused(registry):
    err = rejected(registry, registration(rank=32))
    assert err.param == "adapter_config.r" and "TOKENMILL_MAX_LORA_RANK" in str(err)


def test_target_modules_the_base_lacks_are_refused(registry):
    config = adapter_files.adapter_config(8, ["q_proj", "lm_head"])
    assert rejected(registry, registration(config=config)).param == "adapter_config.target_modules"


def test_a_malformed_config_is_refused(registry):
    assert rejected(registry, registration(config=["not", "an", "object"])).param == "adapter_config"  # type: ignore[arg-type]
    assert rejected(registry, registration(config={**adapter_files.adapter_config(), "peft_type": "IA3"})).param \
        == "adapter_config.peft_type"
    assert rejected(registry, registration(config={**adapter_files.adapter_config(), "use_dora": True})).param \
        == "adapter_config"


def test_weights_of_another_base_model_are_refused(registry):
    err = rejected(registry, registration(base_config=OTHER_CONFIG))
    assert err.param == "weights" and "shape" in str(err) and BASE in str(err)


def test_weights_that_do_not_match_the_rank_are_refused(registry):
    weights = adapter_files.safetensors_bytes(adapter_files.adapter_tensors(BASE_CONFIG, 4))
    assert rejected(registry, registration(rank=8, weights=weights)).param == "weights"


def test_an_integer_dtype_is_refused(registry):
    import torch

    err = rejected(registry, registration(dtype=torch.int8, scale=10.0))
    assert err.param == "weights" and "dtype" in str(err)


def test_a_malformed_or_truncated_file_is_refused(registry):
    good = registration().weights
    for weights in (b"", b"garbage", good[: len(good) // 2]):
        assert rejected(registry, registration(weights=weights)).param == "weights"


def test_a_too_large_file_is_refused(registry):
    weights = adapter_files.safetensors_bytes(adapter_files.adapter_tensors(BASE_CONFIG, 8))
    registry.max_bytes = len(weights) - 1
    err = rejected(registry, registration(weights=weights))
    assert err.param == "weights" and err.code == "adapter_too_large"


def test_weights_must_be_base64():
    with pytest.raises(AdapterRejected) as info:
        decode_weights("not base64!")
    assert info.value.param == "weights"


def test_model_ids():
    assert adapters.split_model_id("smollm2-135m-instruct:acme-support") == ("smollm2-135m-instruct", "acme-support")
    assert adapters.split_model_id("org/model:x") == ("org/model", "x")
    assert adapters.split_model_id("smollm2-135m-instruct") is None
    assert adapters.split_model_id(":x") is None


def test_the_registry_loads_without_torch():
    code = ("import sys; import ingress.tenancy.adapter_registry; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------- weights that would reach other tenants
def _with_value(name_part: str, value: float, dtype=None) -> bytes:
    tensors = adapter_files.adapter_tensors(BASE_CONFIG, dtype=dtype)
    target = next(k for k in tensors if name_part in k)
    tensors[target] = tensors[target].clone()
    tensors[target].view(-1)[3] = value
    return adapter_files.safetensors_bytes(tensors)


@pytest.mark.parametrize("value", [3e38, float("nan"), float("inf"), 1e5])
def test_weights_past_the_bound_are_refused_naming_the_tensor(registry, value):
    err = rejected(registry, registration(weights=_with_value("layers.1.self_attn.v_proj.lora_A", value)))
    assert err.param == "weights" and "layers.1.self_attn.v_proj.lora_A.weight" in str(err), err
    assert ("NaN or infinite" in str(err)) if value != value or value > 3.4e38 else ("over the bound of 10000" in str(err))


def test_the_bound_applies_to_lora_b_after_scaling_and_to_bfloat16(registry):
    import torch

    # 9000 alone is within the bound; times lora_alpha / r = 2 it is not
    err = rejected(registry, registration(weights=_with_value("layers.0.self_attn.q_proj.lora_B", 9000.0)))
    assert "lora_B.weight' scaled by 2 reaches 1.8e+04" in str(err), err
    err = rejected(registry, registration(weights=_with_value("layers.0.self_attn.q_proj.lora_A", 3e38, torch.bfloat16)))
    assert "lora_A.weight" in str(err) and "over the bound" in str(err), err
    registry.register(registration(dtype=torch.bfloat16), adapters.AdapterCatalog())  # a good bf16 adapter


def test_an_alpha_past_the_bound_is_refused(registry):
    err = rejected(registry, registration(config=adapter_files.adapter_config(alpha=1e300)))  # type: ignore[arg-type]
    assert err.param == "adapter_config.lora_alpha" and "over the bound of 1024" in str(err), err
    registry.register(registration(config=adapter_files.adapter_config(alpha=64)), adapters.AdapterCatalog())


def _with_header(weights: bytes, edit) -> bytes:
    n = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + weights[8 + n:]


def _first(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


HEADER_EDITS = {
    "string offsets": lambda h: _first(h).update(data_offsets=[str(o) for o in _first(h)["data_offsets"]]),
    "begin after end": lambda h: _first(h).update(data_offsets=_first(h)["data_offsets"][::-1]),
    "size not shape times dtype": lambda h: _first(h).update(shape=[_first(h)["shape"][0], 1]),
    "float shape": lambda h: _first(h).update(shape=[float(d) for d in _first(h)["shape"]]),
    "overlapping tensors": lambda h: [e.update(data_offsets=_first(h)["data_offsets"]) for k, e in h.items()
                                      if k != "__metadata__"][:0],
    "metadata not strings": lambda h: h.update(__metadata__={"format": 1}),
}


@pytest.mark.parametrize("edit", list(HEADER_EDITS))
def test_headers_the_safetensors_library_refuses_are_refused(registry, edit):
    weights = _with_header(registration().weights, HEADER_EDITS[edit])
    assert rejected(registry, registration(weights=weights)).param == "weights"


def test_a_deeply_nested_header_is_refused(registry):
    text = b"[" * 100_000 + b"]" * 100_000
    weights = len(text).to_bytes(8, "little") + text
    assert rejected(registry, registration(weights=weights)).param == "weights"


# ----------------------------------------------------------------------------- bounds on what a tenant stores
def test_a_tenant_over_its_adapter_count_or_bytes_is_refused_and_nothing_is_stored(base_dir):
    registry = AdapterRegistry({BASE: ModelSpec(BASE, base_dir)}, publisher=FakePublisher(), max_rank=16,
                               max_bytes=2**20, max_per_tenant=2, max_bytes_per_tenant=10**9)
    catalog = adapters.AdapterCatalog()
    for name in ("one", "two"):
        manifest = registry.register(registration(name=name), catalog)
        catalog.apply_manifest(manifest["adapter_id"], manifest)
    registry.publisher.published.clear()
    err = rejected(registry, registration(name="three"), catalog)
    assert err.code == "adapter_quota_exceeded" and "TOKENMILL_MAX_ADAPTERS_PER_TENANT=2" in str(err)
    registry.register(registration(name="three", tenant="other"), catalog)  # another tenant's count is its own
    registry.publisher.published.clear()
    size = len(registration().weights)
    registry.max_per_tenant, registry.max_bytes_per_tenant = 10, 2 * size + size // 2
    err = rejected(registry, registration(name="three"), catalog)
    assert err.code == "adapter_quota_exceeded" and err.param == "weights" and "BYTES_PER_TENANT" in str(err)


def test_two_registrations_of_one_name_at_once_store_one(registry):
    """The clash check and the publish are one step per tenant: the second sees the first."""
    import threading
    import time

    publish = registry.publisher.publish

    def slow_publish(manifest, chunks):
        time.sleep(0.2)  # both requests are past their reads of the catalog before either is acknowledged
        publish(manifest, chunks)

    registry.publisher.publish = slow_publish
    catalog = adapters.AdapterCatalog()  # a view that shows neither yet (both are in flight)
    outcomes: list[str] = []

    def attempt(seed):
        try:
            registry.register(registration(seed=seed), catalog)
            outcomes.append("stored")
        except AdapterRejected as exc:
            outcomes.append(exc.code)

    threads = [threading.Thread(target=attempt, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(outcomes) == ["adapter_exists", "stored"] and len(registry.publisher.published) == 1


def test_orphan_chunks_are_found_and_swept_and_kept_by_no_view():
    catalog = adapters.AdapterCatalog(keep_chunks=True)

    def feed(manifest, chunks, at_ms, with_manifest=True):
        for c in chunks:
            catalog.apply_chunk(checks.adapter_chunk_key(c["adapter_id"], c["version"], c["index"]), c, at_ms)
        if with_manifest:
            catalog.apply_manifest(manifest["adapter_id"], manifest)

    def records(name, weights):
        return adapters.new_records(tenant_id="acme", name=name, base_model=BASE, adapter_config="{}",
                                    weights=weights, rank=8, target_modules=["q_proj"], chunk_bytes=4)

    live, live_chunks = records("live", b"live weights")
    old, old_chunks = records("live", b"older weights")  # the same name's earlier version
    failed, failed_chunks = records("failed", b"never finished")  # its manifest never made it
    young, young_chunks = records("young", b"in flight now")  # a registration under way
    feed(old, old_chunks, 1_000)
    feed(live, live_chunks, 2_000)
    feed(failed, failed_chunks, 3_000, with_manifest=False)
    feed(young, young_chunks, 9_000, with_manifest=False)
    assert set(catalog.chunks) == {("acme/live", live["version"]), ("acme/failed", failed["version"]),
                                   ("acme/young", young["version"])}  # the old version went with its successor
    orphans = catalog.orphan_chunk_keys(older_than_ms=5_000)
    assert orphans == sorted(checks.adapter_chunk_key(c["adapter_id"], c["version"], c["index"])
                             for c in old_chunks + failed_chunks)
    publisher = FakePublisher()
    assert adapters.sweep(publisher, catalog, grace_s=-1e9) != []  # any age: the young one too
    tombstoned = {key for _, keys in publisher.deleted for key in keys}
    for key in tombstoned:
        catalog.apply_chunk(key, None)
    live_keys = {checks.adapter_chunk_key(c["adapter_id"], c["version"], c["index"]) for c in live_chunks}
    assert set(catalog.chunk_keys) == live_keys and not tombstoned & live_keys
    assert catalog.orphan_chunk_keys(10**15) == [] and catalog.weights(live) == b"live weights"
    # what a restarted worker's view keeps after its catch-up: only the bytes of live versions
    restarted = adapters.AdapterCatalog(keep_chunks=True)
    for c in failed_chunks + live_chunks:
        restarted.apply_chunk(checks.adapter_chunk_key(c["adapter_id"], c["version"], c["index"]), c, 1)
    restarted.apply_manifest(live["adapter_id"], live)
    assert restarted.prune() == 1 and set(restarted.chunks) == {("acme/live", live["version"])}


def test_delete_tombstones_every_chunk_of_the_id(registry):
    catalog = adapters.AdapterCatalog()
    old, old_chunks = adapters.new_records(tenant_id="acme", name="support", base_model=BASE, adapter_config="{}",
                                           weights=b"older", rank=8, target_modules=["q_proj"], chunk_bytes=2)
    for c in old_chunks:  # an earlier version's chunks the topic still holds
        catalog.apply_chunk(checks.adapter_chunk_key(c["adapter_id"], c["version"], c["index"]), c, 1)
    manifest = registry.register(registration(), catalog)
    catalog.apply_manifest(manifest["adapter_id"], manifest)
    registry.delete("acme", "support", catalog)
    [(deleted, keys)] = registry.publisher.deleted
    assert deleted == manifest
    assert set(keys) >= {checks.adapter_chunk_key("acme/support", old["version"], c["index"]) for c in old_chunks}
