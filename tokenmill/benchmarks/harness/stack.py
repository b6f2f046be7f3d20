"""A whole tokenmill of the benchmark's own in a temporary directory: its KRaft broker, chDB directory and
ports, so that a running `make up` is neither disturbed nor measured."""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infra.paths import local_dir
from tokenmill.benchmarks.harness.client import MODEL_NAME, Answer, open_loop

if TYPE_CHECKING:
    from tokenmill.stack.kafka_broker import LocalKafka

SECRET = "bench-control-plane-secret"
ADMIN_TOKEN = "bench-control-plane-admin"


@dataclass
class PrivateStack:
    """Broker, billing, streams, one worker (or `workers` of them) and one ingress in a temporary directory."""
    work: Path
    port: int = 0
    billing_url: str = ""
    admin_port: int = 0
    services: dict = field(default_factory=dict)
    broker: LocalKafka | None = None

    model_name: str = MODEL_NAME
    worker_metrics_ports: list = field(default_factory=list)

    def start(self, worker_threads: int, model_size: str = "tiny", kv_cache_mb: float = 64,
              env_extra: dict[str, str] | None = None, workers: int = 1) -> None:
        from gpu_consumers.default_model import build_default_model
        from infra.kafka import clients as kafka_clients
        from tokenmill.stack.kafka_broker import LocalKafka
        from tokenmill.stack.processes import free_port, start_stack
        from tokenmill.stack.spec import StackSpec, WorkerSpec

        model = build_default_model(local_dir() / "models" / model_size, size=model_size)
        self.broker = LocalKafka(self.work / "kafka", port=free_port(), controller_port=free_port())
        bootstrap = self.broker.start()
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
        os.environ["TOKENMILL_KEY_SECRET"] = SECRET
        kafka_clients.create_topics()
        self.worker_metrics_ports = [free_port() for _ in range(workers)]
        self.port, self.admin_port = free_port(), free_port()
        spec = StackSpec(
            env={"KAFKA_BOOTSTRAP_SERVERS": bootstrap, "TOKENMILL_KEY_SECRET": SECRET,
                 "TOKENMILL_MODELS": f"{self.model_name}={model}",
                 "TOKENMILL_CLICKHOUSE_URL": f"chdb://{self.work / 'clickhouse'}",
                 "TOKENMILL_ADMIN_TOKEN": ADMIN_TOKEN, "TOKENMILL_INTERNAL_TOKEN": "bench-control-plane-internal",
                 "TOKENMILL_STREAMS_METRICS_PORT": str(free_port()),
                 "TOKENMILL_BATCH_DIR": str(self.work / "batches"), **(env_extra or {})},
            ingress_port=self.port, billing_port=free_port(), admin_port=self.admin_port,
            workers=[WorkerSpec("worker" if i == 0 else f"worker-{i}", f"bench-worker-{i}", self.model_name, model,
                                port, worker_threads, kv_cache_mb) for i, port in enumerate(self.worker_metrics_ports)])
        self.billing_url = spec.billing_url
        self.services = start_stack(spec, self.work, log_timeout=180)

    def worker_names(self) -> list[str]:
        return [name for name in self.services if name == "worker" or name.startswith("worker-")]

    def restart(self, name: str, env_extra: dict[str, str], ready_marker: str) -> None:
        """Restart one service with changed settings, and wait until it logs `ready_marker`."""
        service = self.services[name]
        service.stop()
        service.env.update(env_extra)
        service.start()
        service.wait_log(ready_marker, timeout=120)

    def tenant_key(self, tenant_id: str, rate: float, seconds: float) -> str:
        from ingress.tenancy.tenant_admin import TenantAdmin

        admin = TenantAdmin(SECRET.encode())
        # Limits far above the load: the benchmark measures throughput, not the quota's refusals.
        admin.upsert(tenant_id, name=tenant_id, requests_per_minute=int(rate * max(seconds, 60) * 4) + 1000,
                     tokens_per_minute=10**9, max_concurrent=100_000, max_queued=100_000,
                     monthly_token_budget=10**15)
        return admin.issue_key(tenant_id).key

    def wait_key_live(self, key: str, timeout: float = 30.0) -> list[Answer]:
        """A new key is usable once ingress (and streams) have read the tenant snapshot. Returns the
        probe that got through: it is billed too, so the ledger check must count it."""
        deadline = time.monotonic() + timeout
        while True:
            answers, _ = asyncio.run(open_loop(self.port, key, 1000.0, 0.001, 1, 4, seed=0))
            if answers and answers[0].status == 200:
                return answers
            if time.monotonic() > deadline:
                raise TimeoutError(f"the benchmark tenant's key never worked: {answers[0].error}")
            time.sleep(0.5)

    def pids(self) -> dict[str, int]:
        found = {name: s.proc.pid for name, s in self.services.items() if s.proc}
        broker_pid = self.broker.running_pid() if self.broker is not None else None
        if broker_pid:
            found["kafka"] = broker_pid
        return found

    def stop(self) -> None:
        for s in reversed(list(self.services.values())):
            s.stop()
        if self.broker is not None:
            self.broker.stop()
