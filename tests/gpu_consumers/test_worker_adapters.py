"""A worker's adapters (gpu_consumers/adapter_cache.py): written to disk from its view of `adapters` on
first need, served by version even after a delete, and a clear error, not a hang, when they never come."""
from __future__ import annotations

import threading

import pytest

from gpu_consumers.adapter_cache import ADAPTER_WAITING, AdapterCache, AdapterUnavailable
from infra import adapters
from schemas import checks


class StubFollower:
    def __init__(self):
        self.catalog = adapters.AdapterCatalog(keep_chunks=True)
        self.lock = threading.Lock()


def cache_with(tmp_path, wait_s=10.0):
    cache = AdapterCache("w", cache_dir=tmp_path / "cache", wait_s=wait_s)
    cache.follower = StubFollower()  # type: ignore[assignment]
    return cache


def registered(cache, weights=b"safetensors bytes", chunk_bytes=4):
    manifest, chunks = adapters.new_records(tenant_id="acme", name="support", base_model="base",
                                            adapter_config='{"r": 8}', weights=weights, rank=8,
                                            target_modules=["q_proj"], chunk_bytes=chunk_bytes)
    return manifest, chunks


def feed(cache, manifest, chunks):
    for c in chunks:
        cache.catalog.apply_chunk(checks.adapter_chunk_key(c["adapter_id"], c["version"], c["index"]), c)
    cache.catalog.apply_manifest(manifest["adapter_id"], manifest)


def request_for(manifest, request_id="r1"):
    return {"request_id": request_id, "adapter": {"adapter_id": manifest["adapter_id"], "name": manifest["name"],
                                                  "version": manifest["version"]}}


def test_a_base_model_request_has_no_lora(tmp_path):
    assert cache_with(tmp_path).lora_for({"request_id": "r", "adapter": None}) is None


def test_an_adapter_is_written_on_first_need_and_served_by_version_after_a_delete(tmp_path):
    cache = cache_with(tmp_path)
    manifest, chunks = registered(cache)
    feed(cache, manifest, chunks)
    lora = cache.lora_for(request_for(manifest))
    assert lora.adapter_id == f"acme/support@{manifest['version'][:12]}"
    assert (tmp_path / "cache" / manifest["version"] / "adapter_model.safetensors").read_bytes() == b"safetensors bytes"
    assert (tmp_path / "cache" / manifest["version"] / "adapter_config.json").read_text() == '{"r": 8}'
    cache.catalog.apply_manifest(manifest["adapter_id"], None)  # deleted: what was admitted still runs
    assert cache.lora_for(request_for(manifest, "r2")).path == lora.path
    assert cache.materialised == 1


def test_a_request_waits_for_an_adapter_its_view_has_not_seen_yet(tmp_path):
    cache = cache_with(tmp_path)
    manifest, chunks = registered(cache)
    assert cache.lora_for(request_for(manifest)) is ADAPTER_WAITING
    feed(cache, manifest, chunks[:-1])
    assert cache.lora_for(request_for(manifest)) is ADAPTER_WAITING  # not whole yet
    feed(cache, manifest, chunks)
    assert cache.lora_for(request_for(manifest)) is not ADAPTER_WAITING


def test_an_adapter_that_never_comes_ends_the_request_with_an_error(tmp_path):
    cache = cache_with(tmp_path, wait_s=0.0)
    manifest, chunks = registered(cache)
    with pytest.raises(AdapterUnavailable) as gone:
        cache.lora_for(request_for(manifest))
    assert gone.value.status == 404 and gone.value.code == "model_not_found"
    feed(cache, manifest, chunks[:1])
    cache.catalog.apply_manifest(manifest["adapter_id"], manifest)
    with pytest.raises(AdapterUnavailable) as partial:
        cache.lora_for(request_for(manifest, "r2"))
    assert partial.value.status == 503 and partial.value.code == "adapter_unavailable"


def test_a_version_registered_again_is_another_adapter_to_the_engine(tmp_path):
    cache = cache_with(tmp_path)
    first, chunks = registered(cache, b"one")
    feed(cache, first, chunks)
    one = cache.lora_for(request_for(first))
    cache.catalog.apply_manifest(first["adapter_id"], None)
    second, chunks = registered(cache, b"two")
    feed(cache, second, chunks)
    two = cache.lora_for(request_for(second, "r2"))
    assert one.adapter_id != two.adapter_id and one.path != two.path
