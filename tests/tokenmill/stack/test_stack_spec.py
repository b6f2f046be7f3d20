"""The one description of a stack (tokenmill/stack/spec.py) that `tokenmill up`, the benchmarks' private
stacks and the integration fixtures start."""
from pathlib import Path

from tokenmill.stack.spec import StackSpec, WorkerSpec


def spec(**overrides) -> StackSpec:
    workers = [WorkerSpec("worker", "w-0", "tiny", Path("/m/tiny"), 9100, threads=2, kv_cache_mb=64),
               WorkerSpec("worker-1", "w-1", "big", Path("/m/big"), 9101, threads=1)]
    return StackSpec(env={"KAFKA_BOOTSTRAP_SERVERS": "k:1", **overrides}, ingress_port=8080, billing_port=8090,
                     workers=workers, admin_port=8081, reply_partition=3)


def test_the_ledger_starts_first_and_ingress_last():
    assert list(spec().commands()) == ["billing", "streams", "worker", "worker-1", "ingress"]


def test_each_worker_runs_its_own_model_under_its_own_id():
    commands = spec().commands()
    assert commands["worker"] == ["serve", "worker", "--model", "/m/tiny", "--model-name", "tiny", "--worker-id", "w-0",
                                  "--threads", "2", "--metrics-port", "9100", "--kv-cache-mb", "64"]
    assert "--kv-cache-mb" not in commands["worker-1"] and commands["worker-1"][5:8] == ["big", "--worker-id", "w-1"]
    assert commands["ingress"] == ["serve", "ingress", "--port", "8080", "--reply-partition", "3", "--admin-port", "8081"]


def test_services_learn_where_billing_and_the_workers_metrics_are_and_the_callers_settings_win():
    env = spec().service_env()
    assert env["TOKENMILL_BILLING_URL"] == "http://127.0.0.1:8090"
    assert env["TOKENMILL_WORKER_METRICS_URLS"] == "http://127.0.0.1:9100/metrics,http://127.0.0.1:9101/metrics"
    assert spec(TOKENMILL_BILLING_URL="http://elsewhere").service_env()["TOKENMILL_BILLING_URL"] == "http://elsewhere"


def test_every_worker_and_both_http_services_are_waited_for():
    ready = spec().readiness()
    assert [(r.service, r.log_marker or r.url) for r in ready] == [
        ("worker", "serving"), ("worker-1", "serving"), ("ingress", "http://127.0.0.1:8080/health"),
        ("billing", "http://127.0.0.1:8090/health")]
