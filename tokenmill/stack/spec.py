"""What a whole tokenmill stack is: which processes, with which arguments and settings, and what says
each is ready. One description, started three ways: `tokenmill up` (tokenmill/stack/local_stack.py, background
processes under .local/), the benchmarks' private stacks and the integration tests' fixtures
(infra/processes.Service, in a directory of their own)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

WORKER_READY = "serving"  # what a worker logs once it reads `work`


@dataclass(frozen=True)
class WorkerSpec:
    service: str  # the process name: "worker", "worker-1", ...
    worker_id: str  # its consumer-group instance id; unique in a pool
    model_name: str
    model_path: Path
    metrics_port: int
    threads: int
    kv_cache_mb: float | None = None

    def args(self) -> list[str]:
        args = ["serve", "worker", "--model", str(self.model_path), "--model-name", self.model_name,
                "--worker-id", self.worker_id, "--threads", str(self.threads),
                "--metrics-port", str(self.metrics_port)]
        if self.kv_cache_mb is not None:
            args += ["--kv-cache-mb", str(self.kv_cache_mb)]
        return args

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass(frozen=True)
class Ready:
    """How to tell a started service is ready: a line in its log, or a 200 from a URL."""
    service: str
    log_marker: str | None = None
    url: str | None = None


@dataclass
class StackSpec:
    env: dict[str, str]  # settings every service gets (KAFKA_BOOTSTRAP_SERVERS, TOKENMILL_MODELS, ...)
    ingress_port: int
    billing_port: int
    workers: list[WorkerSpec] = field(default_factory=list)
    admin_port: int | None = None  # None: ingress picks its own (infra/config.admin_listener)
    reply_partition: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ingress_port}/v1"

    @property
    def billing_url(self) -> str:
        return f"http://127.0.0.1:{self.billing_port}"

    def service_env(self) -> dict[str, str]:
        """The settings with what the services learn of each other: where billing is, and where the
        dashboard's live panel reads the workers."""
        return {"TOKENMILL_BILLING_URL": self.billing_url,
                "TOKENMILL_WORKER_METRICS_URLS": ",".join(w.metrics_url for w in self.workers), **self.env}

    def commands(self) -> dict[str, list[str]]:
        """Each service's `tokenmill` arguments, in the order they start: the ledger first (so usage
        written from the first request on is read), ingress last (so nothing is accepted before
        there is a pool behind it)."""
        ingress = ["serve", "ingress", "--port", str(self.ingress_port), "--reply-partition", str(self.reply_partition)]
        if self.admin_port is not None:
            ingress += ["--admin-port", str(self.admin_port)]
        return {"billing": ["serve", "billing", "--port", str(self.billing_port)],
                "streams": ["serve", "streams"],
                **{w.service: w.args() for w in self.workers},
                "ingress": ingress}

    def readiness(self) -> list[Ready]:
        return [*(Ready(w.service, log_marker=WORKER_READY) for w in self.workers),
                Ready("ingress", url=f"http://127.0.0.1:{self.ingress_port}/health"),
                Ready("billing", url=f"{self.billing_url}/health")]
