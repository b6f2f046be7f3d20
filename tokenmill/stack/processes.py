"""Runs tokenmill services as real subprocesses (integration tests and the benchmarks that start a stack)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from infra import settings

if TYPE_CHECKING:
    from tokenmill.stack.spec import StackSpec


STOP_TIMEOUT_S = 20.0  # a service still running this long after SIGTERM is killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.args = args
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Service":
        # A restarted service appends to the same log: only what this start writes counts.
        self._log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", *self.args], stdout=log,
                                     stderr=subprocess.STDOUT, env=settings.child_environment(self.env),
                                     start_new_session=True)
        return self

    def log(self) -> str:
        """What the current process wrote to its log."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(getattr(self, "_log_from", 0))
            return f.read().decode(errors="replace")

    def exited(self) -> bool:
        """Whether the started process has ended (a service never started has not)."""
        return self.proc is not None and self.proc.poll() is not None

    def wait_log(self, marker: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in self.log():
                return
            if self.exited():
                raise RuntimeError(f"{self.name} exited:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} never logged {marker!r}:\n{self.log()[-3000:]}")

    def wait_http(self, url: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.exited():
                raise RuntimeError(f"{self.name} exited:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"{self.name} did not answer {url}:\n{self.log()[-3000:]}")

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> None:
        stop_all([self])


def stop_all(services: Iterable[Service]) -> None:
    """SIGTERM to every running one first, then wait for each: a stack's services shut down side by side
    (one after the other, a tiny stack took 4 s; its worker and streams 1.5 s each)."""
    stopping = [(service, service.proc) for service in services
                if service.proc is not None and service.proc.poll() is None]
    for _, proc in stopping:
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for service, proc in stopping:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            service.kill()


def start_stack(spec: "StackSpec", log_dir: Path, log_timeout: float = 120) -> dict[str, Service]:
    """Every process of `spec` started in `log_dir` and waited for until ready; all stopped again if
    one never gets there."""
    env = spec.service_env()
    services = {name: Service(name, args, env, log_dir) for name, args in spec.commands().items()}
    for service in services.values():
        service.start()
    try:
        for ready in spec.readiness():
            if ready.log_marker:
                services[ready.service].wait_log(ready.log_marker, timeout=log_timeout)
            elif ready.url:
                services[ready.service].wait_http(ready.url)
    except BaseException:
        stop_all(services.values())
        raise
    return services


def exit_cleanly_on_termination() -> None:
    """Turn SIGTERM and SIGHUP into SystemExit, so a benchmark stopped from outside (by `timeout`, or
    a closed terminal) still runs its `finally` and stops the services it started in their own sessions."""
    def _exit(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGHUP, _exit)


def supervise(command: list[str], restart_codes: set[int] | None, env: dict[str, str] | None = None,
              backoff_s: float = 1.0, max_restarts: int | None = None) -> int:
    """Run `command` as a child and start it again whenever it exits with one of `restart_codes`
    (None: with any status but 0, a crash included);
    return the exit status it finally ends with (128 + N if signal N killed it). SIGTERM and SIGINT go on to the child and end the
    loop, so stopping the supervisor stops the service for good."""
    stopping = 0  # the signal that asked us to stop
    child: subprocess.Popen | None = None

    def forward(signum, _frame):
        nonlocal stopping
        stopping = signum
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    restarts = 0
    while True:
        child = subprocess.Popen(command, env=settings.child_environment(env))
        if stopping:  # told to stop just before this child existed: it is told too
            child.send_signal(stopping)
        code = child.wait()
        restart = code != 0 if restart_codes is None else code in restart_codes
        if stopping or not restart or (max_restarts is not None and restarts >= max_restarts):
            return code if code >= 0 else 128 - code  # a child killed by signal N ends us like a shell: 128 + N
        restarts += 1
        print(f"supervisor: {command[-1]} exited with {code}; starting it again ({restarts})", file=sys.stderr,
              flush=True)
        time.sleep(backoff_s)
        if stopping:  # a stop while no child ran (the backoff): no new child, or it would run on unsignalled
            return 128 + stopping
