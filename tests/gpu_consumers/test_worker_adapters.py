"""A worker's adapters (gpu_consumers/adapter_cache.py): written to disk from its view of `adapters` on
first need, off the caller's thread; a takedown stops new starts at once and removes the files; a version
or id from `work` that could name another path or tenant is refused; a clear error, not a hang, when the
files never come."""
from __future__ import annotations

import threading

import pytest

from gpu_consumers.adapter_cache import ADAPTER_WAITING, AdapterCache, AdapterUnavailable
from lora import adapters
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


def request_for(manifest, request_id="r1", tenant_id="acme"):
    return {"request_id": request_id, "tenant_id": tenant_id,
            "adapter": {"adapter_id": manifest["adapter_id"], "name": manifest["name"], "version": manifest["version"]}}


def lora_of(cache, record):
    """The first answer is WAITING while the directory is written on the cache's own thread."""
    first = cache.lora_for(record)
    if first is not ADAPTER_WAITING:
        return first
    cache.settle()
    return cache.lora_for(record)


def test_a_base_model_request_has_no_lora(tmp_path):
    assert cache_with(tmp_path).lora_for({"request_id": "r", "adapter": None}) is None


def test_an_adapter_is_written_off_the_caller_thread_on_first_need_and_taken_down_at_once(tmp_path):
    cache = cache_with(tmp_path)
    manifest, chunks = registered(cache)
    feed(cache, manifest, chunks)
    writer_threads = []
    real = adapters.materialise

    def spy(*a, **kw):
        writer_threads.append(threading.current_thread())
        return real(*a, **kw)

    adapters.materialise, restore = spy, adapters.materialise
    try:
        assert cache.lora_for(request_for(manifest)) is ADAPTER_WAITING
        cache.settle()
    finally:
        adapters.materialise = restore
    assert writer_threads and threading.current_thread() not in writer_threads
    lora = cache.lora_for(request_for(manifest))
    assert lora.adapter_id == f"acme/support@{manifest['version'][:12]}"
    version_dir = tmp_path / "cache" / manifest["version"]
    assert (version_dir / "adapter_model.safetensors").read_bytes() == b"safetensors bytes"
    assert (version_dir / "adapter_config.json").read_text() == '{"r": 8}'
    assert cache.lora_for(request_for(manifest, "r2")).path == lora.path and cache.materialised == 1
    cache.catalog.apply_manifest(manifest["adapter_id"], None)  # deleted: no new start, though its files are here
    with pytest.raises(AdapterUnavailable) as gone:
        cache.lora_for(request_for(manifest, "r3"))
    assert gone.value.status == 404 and not version_dir.exists()


@pytest.mark.parametrize("ref", [
    {"version": "../../../../etc"}, {"version": "A" * 64}, {"version": "0" * 63}, {"version": None},
    {"adapter_id": "mallory/support"}, {"name": "other"}, {"adapter_id": "acme/../mallory/support"},
])
def test_an_impossible_adapter_reference_names_no_path(tmp_path, ref):
    cache = cache_with(tmp_path)
    manifest, chunks = registered(cache)
    feed(cache, manifest, chunks)
    record = request_for(manifest)
    record["adapter"] = {**record["adapter"], **ref}
    with pytest.raises(AdapterUnavailable) as refused:
        cache.lora_for(record)
    assert refused.value.status == 400 and refused.value.code == "invalid_adapter"
    assert not (tmp_path / "cache").exists()
    assert checks.adapter_ref_problem(record["adapter"], "acme") is not None
    assert checks.adapter_ref_problem(request_for(manifest)["adapter"], "acme") is None
    assert checks.adapter_ref_problem(request_for(manifest)["adapter"], "mallory") is not None


def test_a_request_waits_for_an_adapter_its_view_has_not_seen_yet(tmp_path):
    cache = cache_with(tmp_path)
    manifest, chunks = registered(cache)
    assert cache.lora_for(request_for(manifest)) is ADAPTER_WAITING
    feed(cache, manifest, chunks[:-1])
    assert cache.lora_for(request_for(manifest)) is ADAPTER_WAITING  # not whole yet
    feed(cache, manifest, chunks)
    assert lora_of(cache, request_for(manifest)) is not ADAPTER_WAITING


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
    one = lora_of(cache, request_for(first))
    cache.catalog.apply_manifest(first["adapter_id"], None)
    second, chunks = registered(cache, b"two")
    feed(cache, second, chunks)
    two = lora_of(cache, request_for(second, "r2"))
    assert one.adapter_id != two.adapter_id and one.path != two.path


def test_a_worker_keeps_only_what_it_may_serve(tmp_path):
    """Once written to disk an adapter's bytes leave memory; a version taken down leaves the disk at the
    next sweep, though no request asks for it again."""
    cache = cache_with(tmp_path)
    manifest, chunks = registered(cache)
    feed(cache, manifest, chunks)
    lora = lora_of(cache, request_for(manifest))
    assert cache.catalog.chunks == {}  # the files on disk are the copy served
    assert lora_of(cache, request_for(manifest, "r2")).path == lora.path
    assert cache.sweep_disk() == []
    cache.catalog.apply_manifest(manifest["adapter_id"], None)
    assert cache.sweep_disk() == [manifest["version"]]
    assert not (tmp_path / "cache" / manifest["version"]).exists()
