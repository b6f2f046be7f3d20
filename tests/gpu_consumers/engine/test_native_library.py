"""The kernels' shared library is never loaded from a file someone else could have put there (issue 56):
a planted library in a world-writable cache directory, in a directory of another user, behind a symbolic
link, or owned by another user is never run; the engine's library is built elsewhere and works."""
from __future__ import annotations

import os
import subprocess

import pytest

from gpu_consumers.engine.kernels.native_layer_ops import SIGNATURES
from gpu_consumers.engine.kernels.native_library import NativeLibrary

PLANT = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("TOKENMILL_PLANT_MARKER"), "w");
    if (f) { fputs("planted code ran", f); fclose(f); }
}
"""


def _library(cache_dir) -> NativeLibrary:
    return NativeLibrary("decode_layer_ops.c", SIGNATURES, extra_flags=("-ffp-contract=off",), cache_dir=cache_dir)


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A compiled library whose constructor writes a marker file; returns (its path, the marker path)."""
    source = tmp_path / "plant.c"
    source.write_text(PLANT)
    lib = tmp_path / "plant.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(lib)], check=True)
    marker = tmp_path / "marker"
    monkeypatch.setenv("TOKENMILL_PLANT_MARKER", str(marker))
    return lib, marker


def _assert_built_elsewhere(library: NativeLibrary, cache, marker) -> None:
    functions = library.load()
    assert not marker.exists(), "the planted library's code ran inside the process"
    assert functions is not None and set(functions) == set(SIGNATURES), library.failed
    assert library.loaded_from is not None and not library.loaded_from.startswith(str(cache))


def test_a_world_writable_cache_with_a_planted_library(tmp_path, planted):
    lib, marker = planted
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o777)
    library = _library(cache)
    (cache / library.file_name()).write_bytes(lib.read_bytes())
    _assert_built_elsewhere(library, cache, marker)


def test_a_symbolic_link_in_place_of_the_library_or_the_cache(tmp_path, planted):
    lib, marker = planted
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    library = _library(cache)
    (cache / library.file_name()).symlink_to(lib)
    _assert_built_elsewhere(library, cache, marker)
    linked = tmp_path / "linked-cache"
    linked.symlink_to(cache)
    _assert_built_elsewhere(_library(linked), linked, marker)


@pytest.mark.skipif(os.getuid() != 0, reason="making a file of another user needs root (CI runs as root)")
def test_a_library_or_cache_of_another_user(tmp_path, planted):
    lib, marker = planted
    nobody = 65534
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    library = _library(cache)
    target = cache / library.file_name()
    target.write_bytes(lib.read_bytes())
    os.chmod(target, 0o755)
    os.chown(target, nobody, nobody)
    _assert_built_elsewhere(library, cache, marker)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, nobody, nobody)
    _assert_built_elsewhere(_library(theirs), theirs, marker)


def test_a_private_cache_is_made_0700_built_once_and_reused(tmp_path, monkeypatch):
    cache = tmp_path / "fresh" / "kernels"
    old = os.umask(0o002)  # a permissive umask must not leave the library group-writable
    try:
        first = _library(cache)
        assert first.load() is not None, first.failed
    finally:
        os.umask(old)
    assert (cache.stat().st_mode & 0o777) == 0o700
    built = cache / first.file_name()
    assert first.loaded_from == str(built) and (built.stat().st_mode & 0o077) == 0
    second = _library(cache)
    monkeypatch.setattr(NativeLibrary, "_compile", lambda *a: pytest.fail("rebuilt a cached library"))
    assert second.load() is not None and second.loaded_from == str(built)


# ------------------------------------------------------------------ the wrappers' argument checks
def test_the_engine_tests_run_with_argument_checks():
    from gpu_consumers.engine.kernels.native_library import ArgumentChecks

    assert ArgumentChecks.enabled


def test_a_block_or_slot_outside_the_cache_is_refused_before_the_kernel_runs():
    import torch

    from gpu_consumers.engine.kernels.native_kernels import NativeKernels
    from gpu_consumers.engine.kernels.native_library import KernelArgumentError

    kernels = NativeKernels()
    native_decode_attention, native_layer_ops = kernels.attention, kernels.layer_ops

    if not native_decode_attention.available():
        pytest.fail(f"the kernels did not build here: {native_decode_attention.failed}")
    blocks, block_size, kvh, group, hd = 6, 4, 2, 2, 64
    cache = torch.randn(2, blocks, block_size, kvh, hd)
    q = torch.randn(2, kvh, group, hd)
    tables = torch.tensor([[0, 1], [2, 3]])
    lens = torch.tensor([5, 8])
    assert native_decode_attention(q, cache[0], cache[1], tables, lens) is not None
    for bad_tables, bad_lens, message in ((torch.tensor([[0, 6], [2, 3]]), lens, "block outside"),
                                          (torch.tensor([[0, -1], [2, 3]]), lens, "block outside"),
                                          (tables, torch.tensor([5, 9]), "length lies outside"),
                                          (tables, torch.tensor([0, 8]), "length lies outside")):
        with pytest.raises(KernelArgumentError, match=message):
            native_decode_attention(q, cache[0], cache[1], bad_tables, bad_lens)
    # the second table's unused tail may hold anything: a row of length 5 reads blocks 0 and 1 only
    assert native_decode_attention(q, cache[0], cache[1], torch.tensor([[0, 1, 99], [2, 3, -7]]), lens) is not None

    qkv = torch.randn(3, (4 + 2 * kvh) * hd)
    cos, sin = torch.randn(16, hd), torch.randn(16, hd)
    ok = dict(q_heads=4, kv_heads=kvh, head_dim=hd, cache=cache)
    native_layer_ops.rope_store_kv(qkv, cos, sin, torch.tensor([0, 1, 15]), slots=torch.tensor([0, 5, 23]), **ok)
    with pytest.raises(KernelArgumentError, match="slot lies outside"):
        native_layer_ops.rope_store_kv(qkv, cos, sin, torch.tensor([0, 1, 2]), slots=torch.tensor([0, 5, 24]), **ok)
    with pytest.raises(KernelArgumentError, match="position lies outside"):
        native_layer_ops.rope_store_kv(qkv, cos, sin, torch.tensor([0, 16, 2]), slots=torch.tensor([0, 1, 2]), **ok)
    with pytest.raises(KernelArgumentError, match="narrower"):
        native_layer_ops.rope_store_kv(qkv[:, :-1], cos, sin, torch.tensor([0, 1, 2]), slots=torch.tensor([0, 1, 2]),
                                       **ok)
    h = torch.randn(3, 64)
    with pytest.raises(KernelArgumentError, match="w must be"):
        native_layer_ops.add_rms_norm(h, None, torch.ones(63), 1e-5)
    # a strided delta is copied and kept alive through the call: equal to the contiguous one
    wide = torch.randn(3, 128)
    a, b = h.clone(), h.clone()
    out_strided = native_layer_ops.add_rms_norm(a, wide[:, ::2], torch.ones(64), 1e-5)
    out_plain = native_layer_ops.add_rms_norm(b, wide[:, ::2].contiguous(), torch.ones(64), 1e-5)
    assert torch.equal(a, b) and torch.equal(out_strided, out_plain)
