"""Worker and streams metrics carry tenant ids: they listen on loopback unless told otherwise."""
from __future__ import annotations

import os

import psutil

from gpu_consumers.metrics import WorkerMetrics
from tokenmill.stack.processes import free_port


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(os.getpid()).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_worker_metrics_listen_on_loopback_by_default(monkeypatch):
    monkeypatch.delenv("TOKENMILL_METRICS_HOST", raising=False)
    port = free_port()
    WorkerMetrics("w-bind-test", "m").serve(port)
    assert _listening(port) == {"127.0.0.1"}


def test_the_metrics_host_is_configurable(monkeypatch):
    monkeypatch.setenv("TOKENMILL_METRICS_HOST", "0.0.0.0")
    port = free_port()
    WorkerMetrics("w-bind-test-2", "m").serve(port)
    assert _listening(port) == {"0.0.0.0"}
