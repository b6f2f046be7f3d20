"""The live panel reads the gate's, the workers' and ingress's real metrics registries."""
from prometheus_client import CollectorRegistry, Counter, generate_latest

from billing_pipeline.dashboard.live import LiveSources, live_panel, rejections_panel, worker_panel
from gpu_consumers.metrics import WorkerMetrics
from ingress.metrics import IngressMetrics


def test_worker_panel_reads_a_workers_registry():
    m = WorkerMetrics("w-1", "small")
    m.running.set(5)
    m.waiting.set(2)
    m.kv_usage.set(0.25)
    m.memory_preemptions.inc(3)
    m.prefix_queries.inc(100)
    m.prefix_hits.inc(40)
    [row] = worker_panel(generate_latest(m.registry).decode())
    assert row["worker"] == "w-1" and row["model"] == "small"
    assert (row["running"], row["waiting"], row["kv_usage"]) == (5, 2, 0.25)
    assert row["preemptions"] == 3 and (row["prefix_queries"], row["prefix_hits"]) == (100, 40)


def test_rejections_panel_reads_ingress_refusals():
    m = IngressMetrics()
    m.rejections.labels("429", "rate_limit_exceeded").inc(4)
    m.rejections.labels("401", "invalid_api_key").inc(1)
    rows = rejections_panel(generate_latest(m.registry).decode())
    assert rows == [{"status": "429", "code": "rate_limit_exceeded", "count": 4.0},
                    {"status": "401", "code": "invalid_api_key", "count": 1.0}]


def test_a_source_that_is_down_is_reported_and_the_rest_is_drawn():
    reg = CollectorRegistry()
    Counter("tokenmill:queue_rejected_total", "", ["tenant", "code"], registry=reg).labels("a", "quota").inc(2)
    texts = {"http://gate/metrics": generate_latest(reg).decode()}

    def read(url):
        if url not in texts:
            raise OSError("connection refused")
        return texts[url]

    out = live_panel(LiveSources("http://gate/metrics", ["http://w1/metrics"], "http://ingress/metrics"), read)
    assert out["queue"]["tenants"] == [{"tenant_id": "a", "rejected": 2.0}]
    assert out["workers"] == [] and out["rejections"] == []
    assert len(out["errors"]) == 2 and any("w1" in e for e in out["errors"])
