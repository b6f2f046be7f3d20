"""The kernels' shared library is never loaded from a file someone else could have put there (issue 56):
a planted library in a world-writable cache directory, in a directory of another user, behind a symbolic
link, or owned by another user is never run; the engine's library is built elsewhere and works."""
from __future__ import annotations

import os
import subprocess

import pytest

from gpu_consumers.engine.native_layer_ops import _SIGNATURES
from gpu_consumers.engine.native_library import NativeLibrary

PLANT = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("TOKENMILL_PLANT_MARKER"), "w");
    if (f) { fputs("planted code ran", f); fclose(f); }
}
"""


def _library(cache_dir) -> NativeLibrary:
    return NativeLibrary("decode_layer_ops.c", _SIGNATURES, extra_flags=("-ffp-contract=off",), cache_dir=cache_dir)


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
    assert functions is not None and set(functions) == set(_SIGNATURES), library.failed
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
