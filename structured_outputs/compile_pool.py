"""A small pool of grammar-compile processes for one tokenizer, fair between tenants.

A compile runs in a child process (structured_outputs/compile_child.py) so that one running past its time limit
is really stopped: its process is killed (SIGKILL) and a fresh one started in its place, and the
slot goes to the next compile. xgrammar 0.2.9 offers no cancellation of a running compile (its
``GrammarCompiler`` has no cancel or time-limit argument), and a Python thread cannot be stopped.

A new process imports xgrammar and torch (seconds of CPU) before it serves, so after the first compile
stopped or crashed the pool keeps one spare process started ahead: the slot that lost its process takes
the spare at once and another spare starts in the background (before any stop, nothing is spent on one).

Fairness: waiting compiles queue per tenant and slots are handed out round-robin between tenants,
and one tenant never runs more than ``processes - 1`` compiles at once (with two or more
processes, a slot is always left for the others), so a tenant flooding slow schemas delays only
itself.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from infra import settings

log = logging.getLogger("tokenmill.grammars")

START_TIMEOUT_S = 300.0  # a child imports xgrammar (and torch) before it is ready


@dataclass
class Job:
    key: str
    spec: dict[str, Any]
    tenant: str
    future: Future = field(default_factory=Future)


class Overrun(Exception):
    """The compile ran past its limit; its process was killed."""


class ChildDied(Exception):
    """The compile process ended without answering (it crashed, or was killed from outside)."""


try:  # resolved here, not in the forked child (no loading of libraries between fork and exec)
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):  # pragma: no cover
    _PRCTL = None


def _die_with_parent() -> None:
    """Runs in the child before exec: it is SIGKILLed when the thread that started it ends (its slot,
    or the whole process), so a compile never outlives the server that asked for it."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class _Child:
    def __init__(self, tokenizer_info_json: str):
        env = settings.child_environment()
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "structured_outputs.compile_child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, preexec_fn=_die_with_parent if _PRCTL is not None else None)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both piped above
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self._buf = b""
        self.send({"tokenizer_info": tokenizer_info_json})
        reply = self.receive(time.monotonic() + START_TIMEOUT_S)
        if not reply.get("ready"):
            raise ChildDied(f"compile process answered {reply!r} at start")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: dict) -> None:
        body = json.dumps(message).encode()
        try:
            self.stdin.write(struct.pack(">I", len(body)) + body)
            self.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise ChildDied(str(exc)) from None

    def receive(self, deadline: float) -> dict:
        fd = self.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                if len(self._buf) >= 4:
                    (size,) = struct.unpack(">I", self._buf[:4])
                    if len(self._buf) >= 4 + size:
                        body, self._buf = self._buf[4:4 + size], self._buf[4 + size:]
                        return json.loads(body)
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    if time.monotonic() >= deadline:
                        raise Overrun()
                    continue
                try:
                    chunk = os.read(fd, 1 << 20)
                except OSError as exc:  # closed under it: the pool is closing
                    raise ChildDied(f"compile process pipe closed ({exc})") from None
                if not chunk:
                    raise ChildDied(f"compile process exited ({self.proc.poll()})")
                self._buf += chunk

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for stream in (self.stdin, self.stdout):
            try:
                stream.close()
            except OSError:
                pass


class FairCompileQueue:
    """Waiting jobs per tenant, taken round-robin; at most ``per_tenant_running`` running per tenant."""

    def __init__(self, per_tenant_running: int):
        self.per_tenant_running = max(1, per_tenant_running)
        self._waiting: OrderedDict[str, deque[Job]] = OrderedDict()  # order: whose turn is next
        self._running: dict[str, int] = {}
        self._cond = threading.Condition()
        self._closed = False

    def put(self, job: Job) -> None:
        with self._cond:
            self._waiting.setdefault(job.tenant, deque()).append(job)
            self._cond.notify()

    def take(self) -> Job | None:
        with self._cond:
            while not self._closed:
                for tenant in list(self._waiting):
                    if tenant and self._running.get(tenant, 0) >= self.per_tenant_running:
                        continue  # (a caller that names no tenant, "", is not capped)
                    jobs = self._waiting.pop(tenant)  # re-added last: the next turn is someone else's
                    job = jobs.popleft()
                    if jobs:
                        self._waiting[tenant] = jobs
                    if not job.future.set_running_or_notify_cancel():
                        break  # given up while waiting: look again
                    self._running[tenant] = self._running.get(tenant, 0) + 1
                    return job
                else:
                    self._cond.wait()
            return None

    def done(self, job: Job) -> None:
        with self._cond:
            n = self._running.get(job.tenant, 0) - 1
            if n > 0:
                self._running[job.tenant] = n
            else:
                self._running.pop(job.tenant, None)
            self._cond.notify_all()

    def running(self, tenant: str) -> int:
        with self._cond:
            return self._running.get(tenant, 0)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class CompilePool:
    """``processes`` compile processes; ``submit`` queues a job and returns its future, whose result
    is what ``finish(job, reply)`` makes of the child's reply: a dict ``{"compiled": ...}`` or
    ``{"error": ..., "param": ...}``, or ``{"overrun": limit_s}`` for a compile that was stopped."""

    def __init__(self, tokenizer_info_json: str, processes: int, limit_s: Callable[[], float],
                 finish: Callable[[Job, dict], Any]):
        self._info = tokenizer_info_json
        self._limit_s = limit_s
        self._finish = finish
        self.queue = FairCompileQueue(processes - 1)
        self.started = threading.Event()  # set once a first process is ready
        self._up = threading.Condition()
        self.children: list[_Child | None] = [None] * processes
        self.kills = 0  # compiles stopped at their limit
        self.submitted = 0  # compiles queued (a spec refused before compiling never is)
        self._closed = False
        self._spare: _Child | None = None
        self._spare_wanted = threading.Event()
        self._spare_lock = threading.Lock()
        self._spare_thread: threading.Thread | None = None
        self.spares_used = 0
        self._threads = [threading.Thread(target=self._slot, args=(i,), name=f"grammar-{i}", daemon=True)
                         for i in range(processes)]
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> Future:
        self.submitted += 1
        self.queue.put(job)
        return job.future

    def _spawn(self, i: int) -> _Child | None:
        while not self._closed:
            try:
                child = _Child(self._info)
                with self._up:
                    self.children[i] = child
                    self._up.notify_all()
                self.started.set()
                return child
            except (ChildDied, Overrun, OSError) as exc:
                log.error("grammar compile process %d did not start: %s", i, exc)
                time.sleep(1.0)  # a failing start is retried, not spun on
        return None

    def _want_spare(self) -> None:
        with self._spare_lock:
            if self._spare_thread is None:
                self._spare_thread = threading.Thread(target=self._keep_spare, name="grammar-spare", daemon=True)
                self._spare_thread.start()
        self._spare_wanted.set()

    def _keep_spare(self) -> None:
        while not self._closed:
            self._spare_wanted.wait()
            if self._closed:
                break
            with self._spare_lock:
                have = self._spare is not None
                self._spare_wanted.clear()
            if have:
                continue
            try:
                child = _Child(self._info)
            except (ChildDied, Overrun, OSError) as exc:
                log.error("spare grammar compile process did not start: %s", exc)
                time.sleep(1.0)
                self._spare_wanted.set()
                continue
            with self._spare_lock:
                if self._closed:
                    child.kill()
                    break
                self._spare = child

    def _replacement(self, i: int) -> _Child | None:
        """A process for slot ``i`` after it lost its own: the spare when one is ready (then another is
        started), else a new one started here."""
        self._want_spare()
        with self._spare_lock:
            child, self._spare = self._spare, None
        if child is None or child.proc.poll() is not None:
            return self._spawn(i)
        self.spares_used += 1
        self._spare_wanted.set()
        with self._up:
            self.children[i] = child
            self._up.notify_all()
        return child

    def _slot(self, i: int) -> None:
        child = self._spawn(i)
        while not self._closed and child is not None:
            job = self.queue.take()
            if job is None:
                break
            reply: dict
            try:
                limit = self._limit_s()
                child.send({"spec": job.spec})
                reply = child.receive(time.monotonic() + limit)
            except Overrun:
                log.warning("grammar compile of %s (tenant %s) ran past %.3g s: killing process %d",
                            job.key[:12], job.tenant, limit, child.pid)
                self.kills += 1
                reply = {"overrun": limit}
                child.kill()
                child = self.children[i] = None
            except ChildDied as exc:
                log.error("grammar compile process %d died compiling %s: %s", i, job.key[:12], exc)
                reply = {"error": f"The schema could not be compiled: the compile process died ({exc})."}
                child.kill()
                child = self.children[i] = None
            try:
                job.future.set_result(self._finish(job, reply))
            except Exception as exc:  # noqa: BLE001 - the waiter gets it
                job.future.set_exception(exc)
            finally:
                if child is None:
                    # the new process's start is charged to the tenant whose compile cost the old one:
                    # the slot stays counted as theirs until it serves again
                    child = self._replacement(i)
                self.queue.done(job)

    def wait_all_up(self, timeout: float) -> bool:
        """Whether every slot has a compile process, waiting up to ``timeout`` for it."""
        with self._up:
            return self._up.wait_for(lambda: all(c is not None for c in self.children), timeout)

    def close(self) -> None:
        self._closed = True
        self.queue.close()
        self._spare_wanted.set()
        with self._spare_lock:
            spare, self._spare = self._spare, None
        for child in [*self.children, spare]:
            if child is not None:
                child.kill()
