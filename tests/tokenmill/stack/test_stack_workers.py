"""`TOKENMILL_WORKERS=N make up`: worker names, metrics ports, and what status and down see."""
import pytest

from tokenmill.stack import local_stack as stack


def test_worker_count_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("TOKENMILL_WORKERS", raising=False)
    assert stack.worker_count() == 1
    monkeypatch.setenv("TOKENMILL_WORKERS", "3")
    assert stack.worker_count() == 3
    monkeypatch.setenv("TOKENMILL_WORKERS", "0")
    with pytest.raises(ValueError):
        stack.worker_count()


def test_names_and_ports_keep_the_first_worker_as_it_was_and_never_collide():
    assert [stack.worker_name(i) for i in range(3)] == ["worker", "worker-1", "worker-2"]
    ports = [stack.worker_metrics_port(i) for i in range(12)]
    assert ports[0] == 9101 and len(set(ports)) == 12 and 9102 not in ports  # 9102 is streams'


def test_status_and_down_see_every_started_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_LOCAL_DIR", str(tmp_path))
    (tmp_path / "run").mkdir()
    for name in ("worker", "worker-2", "worker-10", "worker-1", "streams"):
        (tmp_path / "run" / f"{name}.pid").write_text("999999999")  # no such process
    assert stack.started_workers() == ["worker", "worker-1", "worker-2", "worker-10"]
    assert stack.services() == ["streams", "worker", "worker-1", "worker-2", "worker-10", "billing", "ingress"]
    found = stack.status()
    assert [w["name"] for w in found["workers"]] == stack.started_workers()
    assert found["workers"][3]["metrics_url"] == "http://127.0.0.1:9120/metrics"
    assert all(w["pid"] is None for w in found["workers"])  # a stale pid file is not a running worker
