"""llama-batched-bench as the engine benchmark's peer: its JSONL rows are read, and a run that dies of an
illegal instruction (ggml's AMX kernels for repacked Q8_0 weights do on an AMX VM) is run again without the
repack, its rows saying so. A stand-in executable plays llama.cpp here; the real one is the benchmark's."""
import stat

import pytest

from tokenmill.benchmarks.engine import llamacpp

ROW = '{"pl": 16, "speed_pp": 300.0, "speed_tg": 170.0}'


def _stand_in(tmp_path, monkeypatch, body: str) -> None:
    exe = tmp_path / "llama-batched-bench"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(llamacpp, "bin_dir", lambda: tmp_path)


def test_a_run_killed_by_sigill_is_run_again_without_the_repack(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, f"""case "$*" in *--no-repack*) echo '{ROW}' ;; *) kill -ILL $$ ;; esac""")
    rows = llamacpp.batched_bench(tmp_path / "m.gguf", [16], 128, 128, 2)
    assert rows == [{"pl": 16, "speed_pp": 300.0, "speed_tg": 170.0, "repack": False}]


def test_a_run_that_works_keeps_the_repack(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, f"""case "$*" in *--no-repack*) exit 3 ;; *) echo '{ROW}' ;; esac""")
    assert llamacpp.batched_bench(tmp_path / "m.gguf", [16], 128, 128, 2)[0]["repack"] is True


def test_any_other_failure_is_reported_not_retried(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, """echo "$*" >> "$(dirname "$0")/calls"; echo 'model not found' >&2; exit 1""")
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="exited 1: model not found"):
        llamacpp.batched_bench(tmp_path / "m.gguf", [16], 128, 128, 2)
    assert len((tmp_path / "calls").read_text().splitlines()) == 1


def test_the_repack_probe_tells_a_sigill_from_a_working_run(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, "kill -ILL $$")
    assert llamacpp.repack_crashes(tmp_path / "m.gguf")
    _stand_in(tmp_path, monkeypatch, f"echo '{ROW}'")
    assert not llamacpp.repack_crashes(tmp_path / "m.gguf")
