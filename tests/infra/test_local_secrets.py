"""Local secrets and the demo env file: private from the first byte, never read half-made."""
from __future__ import annotations

import stat
import threading

import pytest

from tokenmill.stack import local_stack as stack
from infra import config, settings


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_demo_env_is_readable_by_its_owner_only_even_if_it_existed_before(tmp_path):
    env = tmp_path / "demo.env"
    env.write_text("OLD=1\n")
    env.chmod(0o644)
    stack.write_env(env, {"TOKENMILL_API_KEY": "tm-secret"})
    assert _mode(env) == 0o600
    assert stack.read_env(env) == {"TOKENMILL_API_KEY": "tm-secret"}


def test_a_secret_made_by_racing_processes_is_one_whole_value(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_LOCAL_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENMILL_INTERNAL_TOKEN", raising=False)
    made = iter(range(1000))
    seen: list[str] = []
    start = threading.Barrier(16)

    def read():
        start.wait()
        seen.append(config.local_secret(settings.INTERNAL_TOKEN, "race_secret", lambda: f"secret-{next(made)}"))

    threads = [threading.Thread(target=read) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 16 and len(set(seen)) == 1 and seen[0].startswith("secret-")
    assert _mode(tmp_path / "race_secret") == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["race_secret"]  # no temporary file left


def test_an_empty_secret_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_LOCAL_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENMILL_INTERNAL_TOKEN", raising=False)
    (tmp_path / "empty_secret").write_text("\n")
    with pytest.raises(RuntimeError, match="empty"):
        config.local_secret(settings.INTERNAL_TOKEN, "empty_secret", lambda: "never")
