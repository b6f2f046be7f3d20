"""Starts and stops the whole local stack in the background (what `make up` / `make down` run).

Every process gets a pid file under .local/run/ and a log under .local/logs/; starting
something that already runs is a no-op, so `make up` can be run twice.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tokenmill.stack.kafka_broker import LocalKafka
from tokenmill.stack.kafka_cluster import LocalKafkaCluster
from infra import settings
from infra.paths import local_dir


def run_dir() -> Path:
    return local_dir() / "run"


def log_dir() -> Path:
    return local_dir() / "logs"


def ingress_port() -> int:
    return settings.PORT.get()


def billing_port() -> int:
    return settings.BILLING_PORT.get()


def dev_broker() -> LocalKafka:
    return LocalKafka(local_dir() / "kafka-data", port=19092, controller_port=19093)


# `TOKENMILL_KAFKA_BROKERS=N make up`: N nodes; node i listens on 19090 + 2i (the first where the
# single broker would, so the default bootstrap address reaches either) and its controller on 19091 + 2i.
def cluster_dir() -> Path:
    return local_dir() / "kafka-cluster"


def demo_env_path() -> Path:
    """What `make up` writes the demo tenant's endpoint, key and model to."""
    return local_dir() / "demo.env"


def broker_count() -> int:
    """How many Kafka brokers `make up` starts (``TOKENMILL_KAFKA_BROKERS``, default 1)."""
    return settings.KAFKA_BROKERS.get()


def dev_cluster(size: int) -> LocalKafkaCluster:
    return LocalKafkaCluster(cluster_dir(), [(19090 + 2 * i, 19091 + 2 * i) for i in range(1, size + 1)])


def started_cluster() -> LocalKafkaCluster | None:
    """The local cluster `make up` formatted (whether it runs or not), sized by its node folders."""
    size = len(list(cluster_dir().glob("node-*"))) if cluster_dir().exists() else 0
    return dev_cluster(size) if size else None


def local_kafka() -> LocalKafka | LocalKafkaCluster:
    """What `make up` starts: the single broker, or with TOKENMILL_KAFKA_BROKERS > 1 a cluster.

    Refuses the one kind while the other runs (both listen on 19092)."""
    count = broker_count()
    cluster = started_cluster()
    if count == 1:
        if cluster is not None and cluster.running():
            raise RuntimeError(f"a {len(cluster.nodes)}-broker local cluster runs: `make down` first, or set "
                               f"TOKENMILL_KAFKA_BROKERS={len(cluster.nodes)}")
        return dev_broker()
    if dev_broker().running_pid() is not None:
        raise RuntimeError("the single local broker runs: `make down` first, or unset TOKENMILL_KAFKA_BROKERS")
    if cluster is not None and len(cluster.nodes) != count and cluster.running():
        raise RuntimeError(f"a {len(cluster.nodes)}-broker local cluster runs: `make down` first, or set "
                           f"TOKENMILL_KAFKA_BROKERS={len(cluster.nodes)}")
    return dev_cluster(count)


def local_bootstraps() -> set[str]:
    """Addresses that mean the local broker or cluster (as `.local/demo.env` exports them)."""
    found = {dev_broker().bootstrap, dev_cluster(broker_count()).bootstrap}
    cluster = started_cluster()
    if cluster is not None:
        found.add(cluster.bootstrap)
    return found


def kafka_brokers() -> list[dict]:
    """Every local broker with its address and pid (None: not running): what runs, the single broker
    or a cluster's nodes, else what TOKENMILL_KAFKA_BROKERS asks for."""
    cluster = started_cluster()
    if cluster is not None and cluster.running():
        nodes = cluster.nodes
    elif dev_broker().running_pid() is not None or broker_count() == 1:
        nodes = [dev_broker()]
    else:
        nodes = dev_cluster(broker_count()).nodes
    return [{"node_id": n.node_id, "address": n.bootstrap, "pid": n.running_pid()} for n in nodes]


def stop_kafka() -> list[str]:
    """Stop every local broker that runs (the single one, the cluster's nodes); their addresses."""
    stopped = []
    if dev_broker().running_pid() is not None:
        dev_broker().stop()
        stopped.append(dev_broker().bootstrap)
    cluster = started_cluster()
    if cluster is not None and cluster.running():
        stopped += [n.bootstrap for n in cluster.nodes if n.running_pid() is not None]
        cluster.stop()
    return stopped

FIRST_WORKER_METRICS_PORT = 9101  # the first worker's; streams has 9102


def worker_count() -> int:
    """How many workers `make up` starts (``TOKENMILL_WORKERS``, default 1)."""
    return settings.WORKERS.get()


def worker_name(index: int) -> str:
    """The service name of the index-th worker: `worker` (as before pools existed), then `worker-1`, ..."""
    return "worker" if index == 0 else f"worker-{index}"


def worker_metrics_port(index: int) -> int:
    return FIRST_WORKER_METRICS_PORT if index == 0 else 9110 + index


def started_workers() -> list[str]:
    """The workers that have a pid file, in start order (the first, then by number)."""
    names = [p.stem for p in run_dir().glob("worker*.pid")] if run_dir().exists() else []
    return sorted(names, key=lambda n: 0 if n == "worker" else int(n.rsplit("-", 1)[1]))


def services() -> list[str]:
    """Every service `make up` may have started, in start order; workers beyond the first included."""
    workers = [n for n in started_workers() if n != "worker"]
    return ["streams", "worker", *workers, "billing", "ingress"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours is not alive
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def service_pid(name: str) -> int | None:
    path = run_dir() / f"{name}.pid"
    try:
        pid = int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _alive(pid) else None


def start_service(name: str, args: list[str], env: dict[str, str] | None = None) -> int:
    pid = service_pid(name)
    if pid is not None:
        return pid
    run_dir().mkdir(parents=True, exist_ok=True)
    log_dir().mkdir(parents=True, exist_ok=True)
    with open(log_dir() / f"{name}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=settings.child_environment(env))
    (run_dir() / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def stop_service(name: str, timeout: float = 20.0) -> bool:
    pid = service_pid(name)
    if pid is None:
        (run_dir() / f"{name}.pid").unlink(missing_ok=True)
        return False
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    if _alive(pid):
        os.killpg(pid, signal.SIGKILL)
    (run_dir() / f"{name}.pid").unlink(missing_ok=True)
    return True


def wait_http(url: str, timeout: float, name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service_pid(name) is None:
            raise RuntimeError(f"{name} exited during start; see {log_dir() / (name + '.log')}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} did not answer {url} within {timeout}s; see {log_dir() / (name + '.log')}")


def wait_log(name: str, marker: str, timeout: float) -> None:
    path = log_dir() / f"{name}.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service_pid(name) is None:
            raise RuntimeError(f"{name} exited during start; see {path}")
        if path.exists() and marker in path.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{name} did not report ready within {timeout}s; see {path}")


def status() -> dict:
    brokers = kafka_brokers()
    found: dict = {"kafka": next((b["pid"] for b in brokers if b["pid"] is not None), None), "kafka_brokers": brokers}
    found.update({name: service_pid(name) for name in services()})
    found["workers"] = [{"name": name, "pid": service_pid(name),
                         "metrics_url": f"http://127.0.0.1:{worker_metrics_port(_index(name))}/metrics"}
                        for name in started_workers()]
    return found


def _index(name: str) -> int:
    return 0 if name == "worker" else int(name.rsplit("-", 1)[1])


def write_env(path: Path, values: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # it holds an API key: readable by its owner only, from the first byte written
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file may have been created world-readable
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{k}={v}\n" for k, v in values.items()))


def read_env(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k: v for k, v in pairs}


def dump_status() -> str:
    return json.dumps(status(), indent=2)
