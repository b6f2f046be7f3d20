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

from infra.kafka_broker import LocalKafka
from infra.paths import LOCAL_DIR

RUN_DIR = LOCAL_DIR / "run"
LOG_DIR = LOCAL_DIR / "logs"
INGRESS_PORT = int(os.environ.get("TOKENMILL_PORT", "8080"))
BILLING_PORT = int(os.environ.get("TOKENMILL_BILLING_PORT", "8090"))
DEV_BROKER = LocalKafka(LOCAL_DIR / "kafka-data", port=19092, controller_port=19093)

FIRST_WORKER_METRICS_PORT = 9101  # the first worker's; streams has 9102


def worker_count() -> int:
    """How many workers `make up` starts (``TOKENMILL_WORKERS``, default 1)."""
    count = int(os.environ.get("TOKENMILL_WORKERS") or 1)
    if count < 1:
        raise ValueError("TOKENMILL_WORKERS must be at least 1")
    return count


def worker_name(index: int) -> str:
    """The service name of the index-th worker: `worker` (as before pools existed), then `worker-1`, ..."""
    return "worker" if index == 0 else f"worker-{index}"


def worker_metrics_port(index: int) -> int:
    return FIRST_WORKER_METRICS_PORT if index == 0 else 9110 + index


def started_workers() -> list[str]:
    """The workers that have a pid file, in start order (the first, then by number)."""
    names = [p.stem for p in RUN_DIR.glob("worker*.pid")] if RUN_DIR.exists() else []
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
    path = RUN_DIR / f"{name}.pid"
    try:
        pid = int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _alive(pid) else None


def start_service(name: str, args: list[str], env: dict[str, str] | None = None) -> int:
    pid = service_pid(name)
    if pid is not None:
        return pid
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOG_DIR / f"{name}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env={**os.environ, **(env or {})})
    (RUN_DIR / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def stop_service(name: str, timeout: float = 20.0) -> bool:
    pid = service_pid(name)
    if pid is None:
        (RUN_DIR / f"{name}.pid").unlink(missing_ok=True)
        return False
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    if _alive(pid):
        os.killpg(pid, signal.SIGKILL)
    (RUN_DIR / f"{name}.pid").unlink(missing_ok=True)
    return True


def wait_http(url: str, timeout: float, name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service_pid(name) is None:
            raise RuntimeError(f"{name} exited during start; see {LOG_DIR / (name + '.log')}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} did not answer {url} within {timeout}s; see {LOG_DIR / (name + '.log')}")


def wait_log(name: str, marker: str, timeout: float) -> None:
    path = LOG_DIR / f"{name}.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service_pid(name) is None:
            raise RuntimeError(f"{name} exited during start; see {path}")
        if path.exists() and marker in path.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{name} did not report ready within {timeout}s; see {path}")


def status() -> dict:
    found: dict = {"kafka": DEV_BROKER.running_pid()}
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
