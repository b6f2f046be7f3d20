"""`tokenmill queue` renders the metrics streams exports."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from infra.queue_metrics import summarize
from streams import queue_view


def test_queue_view_renders_depth_credits_and_waits():
    reg = CollectorRegistry()
    Gauge("tokenmill:streams_active", "", registry=reg).set(1)
    depth = Gauge("tokenmill:queue_depth", "", ["tenant", "priority"], registry=reg)
    depth.labels("acme", "interactive").set(7)
    Counter("tokenmill:queue_shed", "", ["tenant", "reason"], registry=reg).labels("acme", "deadline_expired").inc(3)
    Gauge("tokenmill:queue_credits", "", ["model"], registry=reg).labels("tiny").set(2)
    h = Histogram("tokenmill:queue_wait_seconds", "", ["priority"], registry=reg, buckets=(0.01, 0.1, 1))
    for v in (0.005, 0.005, 0.05, 0.5):
        h.labels("interactive").observe(v)
    Gauge("tokenmill:queue_running", "", ["tenant"], registry=reg).labels("acme").set(64)
    pre = Counter("tokenmill:queue_preemptions", "", ["tenant", "reason"], registry=reg)
    pre.labels("acme", "fairness").inc(5)
    pre.labels("acme", "priority").inc(2)
    Gauge("tokenmill:fairness_jain_index", "", registry=reg).set(0.75)
    text = queue_view.render(summarize(generate_latest(reg).decode()))
    assert "active" in text
    assert any(line.startswith("acme") and " 7" in line and "interactive" in line for line in text.splitlines())
    assert any(line.startswith("acme") and "*" in line and " 3" in line for line in text.splitlines())
    assert any(line.startswith("tiny") and " 2" in line for line in text.splitlines())
    assert "p50 <= 10 ms" in text
    assert any(line.split() == ["acme", "64", "5", "2"] for line in text.splitlines())
    assert "Jain's index 0.750" in text
