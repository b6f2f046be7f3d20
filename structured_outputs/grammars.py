"""Structured output: the grammar a request's answer must match, compiled once per spec and process.

Ingress compiles a request's schema before it queues the request, so a schema that is invalid,
too large or too slow to compile is a 400 before any GPU time is spent; the worker compiles it
again (its own cache, usually a hit) and gives the engine one matcher per choice. Both key their
caches by the spec's canonical JSON, so a repeated schema compiles once per process.

A spec is what travels in ``InferenceRequested.response_format`` (JSON text):
``{"type": "json_object"}`` or ``{"type": "json_schema", "schema": {...}, "strict": bool}``.
The grammar library is a backend (structured_outputs/backend.py; the one used is xgrammar,
structured_outputs/xgrammar_backend.py); this module is the cache, the cost limits and the compile processes
around it, which are the same whatever compiles.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from infra import settings
from structured_outputs.backend import GrammarBackend
from structured_outputs.errors import GrammarBusy, GrammarError
from structured_outputs.schema_limits import SchemaLimits, SchemaTooCostly, check_schema
from structured_outputs.xgrammar_backend import GrammarConstraint, XgrammarBackend


def max_schema_bytes() -> int:
    return settings.MAX_SCHEMA_BYTES.get()


def compile_timeout_s() -> float:
    return settings.GRAMMAR_COMPILE_TIMEOUT_S.get()


def compile_processes() -> int:
    """Compile processes per model (each a killable xgrammar compile, structured_outputs/compile_pool.py)."""
    return settings.GRAMMAR_COMPILE_PROCESSES.get()


def warm_at_start() -> bool:
    """Whether a worker starts its compile processes when it starts rather than at its first
    structured-output request (which would wait for them)."""
    return settings.GRAMMAR_WARM.get()


def queue_wait_s() -> float:
    """How long a compile may wait for a slot before the request is answered busy (503)."""
    return settings.GRAMMAR_QUEUE_WAIT_S.get()


def max_compiles_per_tenant() -> int:
    """Compiles one tenant may have waiting or running at once (more: 503 for that tenant only)."""
    return settings.GRAMMAR_COMPILES_PER_TENANT.get()


STARTUP_WAIT_S = 300.0  # a first compile waits this long for a compile process to come up


MAX_WAITING_COMPILES = 64
# How long a compile stopped at its time limit is answered from the cache before the schema is tried again.
OVERRUN_REMEMBERED_S = 300.0


def _blame(spec: dict[str, Any]) -> str:
    """The request field a spec's size or compile time is charged to."""
    return "tools" if spec.get("type") == "tool_calls" else "response_format.json_schema.schema"


def spec_key(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class GrammarCompiler:
    """Compiles specs for one tokenizer, caches the results, and makes matchers.

    Before anything compiles, a spec's cost is bounded (structured_outputs/schema_limits.py: nesting, keys, enum
    values, nested regex repetitions), a 400 naming the field. Compiles then run in a small pool of
    processes (structured_outputs/compile_pool.py), fair between tenants: one that runs past its limit
    (TOKENMILL_GRAMMAR_COMPILE_TIMEOUT_S) is killed with its process, and the spec's digest is
    remembered with that error, so a retry fails at once without a slot."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_entries: int = 256,
                 processes: int | None = None, limit_s: float | None = None,
                 limits: SchemaLimits | None = None):
        from structured_outputs.compile_pool import CompilePool

        self.backend: GrammarBackend = XgrammarBackend.for_tokenizer(tokenizer, vocab_size, stop_token_ids)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self._compiling: dict[str, tuple[Future, str]] = {}  # key -> (future, tenant that asked first)
        self._asked_at: dict[str, float] = {}  # key -> when ready() first waited for it
        self.limits = limits or SchemaLimits()
        self._limit_s = limit_s
        self.processes = processes or compile_processes()
        self.pool = CompilePool(self.backend.tokenizer_json(), self.processes, self.limit_s, self._finish)

    def limit_s(self) -> float:
        """How long one compile may run before its process is killed."""
        return self._limit_s if self._limit_s is not None else compile_timeout_s()

    def close(self) -> None:
        self.pool.close()

    def compile_uncached(self, spec: dict[str, Any]):
        """Compile here, in this process, with no cache, no limit and no pool: for benchmarks
        (tokenmill bench structured measures a first compile with it), never for requests."""
        return self.backend.compile(spec)

    def _value_of(self, spec: dict[str, Any], reply: dict):
        if "compiled" in reply:
            try:
                return self.backend.deserialize(reply["compiled"])
            except Exception as exc:  # noqa: BLE001
                return GrammarError(f"The schema could not be compiled: {type(exc).__name__}: {exc}", _blame(spec))
        if "overrun" in reply:
            error = GrammarError(f"The schema did not compile within {reply['overrun']:g} s "
                                 f"(TOKENMILL_GRAMMAR_COMPILE_TIMEOUT_S); the compile was stopped. Simplify it "
                                 f"(fewer nested repetitions in its patterns).", _blame(spec))
            # An overrun may be the machine's load, not the schema's: remembered a while, not for good.
            error.expires_at = time.monotonic() + OVERRUN_REMEMBERED_S
            return error
        return GrammarError(reply.get("error") or "The schema could not be compiled.",
                            reply.get("param") or _blame(spec))

    def _finish(self, job, reply: dict):
        """A compile process answered (or was stopped): the result is stored, whatever it is."""
        value = self._value_of(job.spec, reply)
        self._store(job.key, value)
        with self._lock:
            self._compiling.pop(job.key, None)
            self._asked_at.pop(job.key, None)
        return value

    def _cached(self, key: str):
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and getattr(hit, "expires_at", None) is not None and hit.expires_at < time.monotonic():
                del self._cache[key]  # an overrun remembered long enough: the next ask compiles again
                return None
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _store(self, key: str, value) -> None:
        with self._lock:
            self._cache[key] = value
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)

    def _check(self, spec: dict[str, Any]) -> None:
        """The cost limits, before compiling; GrammarError naming the field."""
        size = len(json.dumps(spec))
        if size > max_schema_bytes():
            raise GrammarError(f"The schema is {size} bytes; the limit is {max_schema_bytes()} "
                               f"(TOKENMILL_MAX_SCHEMA_BYTES).", _blame(spec))
        parts = ([(tool.get("parameters"), f"tools.{tool.get('index', i)}.function.parameters")
                  for i, tool in enumerate(spec.get("tools") or [])] if spec.get("type") == "tool_calls"
                 else [(spec.get("schema"), "response_format.json_schema.schema")])
        for schema, param in parts:
            try:
                check_schema(schema, self.limits)
            except SchemaTooCostly as exc:
                raise GrammarError(str(exc), param) from None

    def _future(self, key: str, spec: dict[str, Any], tenant: str | None) -> Future:
        tenant = tenant or ""
        with self._lock:
            entry = self._compiling.get(key)
            if entry is not None:
                return entry[0]
            if len(self._compiling) >= MAX_WAITING_COMPILES:
                raise GrammarBusy("Too many schemas are being compiled right now; retry shortly.", _blame(spec))
            # a caller that names no tenant (an old call site) is capped only by the total
            if tenant and sum(1 for _, t in self._compiling.values() if t == tenant) >= max_compiles_per_tenant():
                raise GrammarBusy(f"Too many of your schemas are being compiled right now (at most "
                                  f"{max_compiles_per_tenant()} at a time); retry shortly.", _blame(spec))
        from structured_outputs.compile_pool import Job

        job = Job(key, spec, tenant)
        with self._lock:
            entry = self._compiling.get(key)
            if entry is not None:
                return entry[0]
            self._compiling[key] = (job.future, tenant)
        return self.pool.submit(job)

    def _admitted(self, spec: dict[str, Any], key: str):
        """The stored result for ``key``, or None; a spec over the cost limits is remembered refused."""
        value = self._cached(key)
        if value is None:
            try:
                self._check(spec)
            except GrammarError as exc:
                self._store(key, exc)
                value = exc
        return value

    def _give_up(self, key: str, fut: Future, spec: dict[str, Any], waited: float) -> GrammarBusy:
        if fut.cancel():  # still queued: nobody is left waiting for it
            with self._lock:
                self._compiling.pop(key, None)
                self._asked_at.pop(key, None)
        return GrammarBusy(f"The schema waited {waited:.3g} s for a compile slot; retry shortly.", _blame(spec))

    def refuse_costly(self, spec: dict[str, Any]) -> None:
        """GrammarError at once for a spec over the cost limits (or refused before): checking costs tens of
        microseconds, so a caller does it before spending anything else (tokenizing, a thread) on the request."""
        value = self._admitted(spec, spec_key(spec))
        if isinstance(value, GrammarError):
            raise value

    def compile(self, spec: dict[str, Any], timeout_s: float | None = None, tenant: str | None = None):
        """The compiled grammar; GrammarError if the spec is bad, too costly or too slow to compile,
        GrammarBusy if it could not get a compile slot in time. ``tenant`` is who asks (compile slots
        are shared fairly between tenants); ``timeout_s`` bounds the wait for a slot."""
        key = spec_key(spec)
        value = self._admitted(spec, key)
        if value is None:
            fut = self._future(key, spec, tenant)
            if not self.pool.started.wait(STARTUP_WAIT_S):
                raise GrammarBusy("The grammar compiler is starting; retry shortly.", _blame(spec))
            wait = queue_wait_s() if timeout_s is None else timeout_s
            began = time.monotonic()
            try:
                value = fut.result(timeout=wait + self.limit_s())
            except FutureTimeout:
                if not fut.running():
                    raise self._give_up(key, fut, spec, time.monotonic() - began) from None
                try:  # compiling: its limit stops it soon
                    value = fut.result(timeout=self.limit_s() + 5.0)
                except FutureTimeout:
                    raise GrammarBusy("The grammar compiler is overloaded; retry shortly.", _blame(spec)) from None
            except CancelledError:
                raise GrammarBusy("The schema waited too long for a compile slot; retry shortly.",
                                  _blame(spec)) from None
        if isinstance(value, GrammarError):
            raise value
        return value

    def ready(self, spec: dict[str, Any], tenant: str | None = None):
        """The compiled grammar if it is ready, else None (compiling goes on in the background), so a
        worker never compiles on its step loop. Raises GrammarError for a bad or too costly spec or one
        stopped at its limit, and GrammarBusy once it has waited longer than a slot wait and a compile
        limit (the wait is bounded: a request never hangs on its grammar)."""
        key = spec_key(spec)
        value = self._admitted(spec, key)
        if value is None:
            fut = self._future(key, spec, tenant)
            if not fut.done():
                now = time.monotonic()
                with self._lock:
                    asked = self._asked_at.setdefault(key, now)
                if not self.pool.started.is_set():
                    with self._lock:
                        self._asked_at[key] = now  # the wait counts from when a compile process is up
                    return None
                waited = now - asked
                if waited > queue_wait_s() + self.limit_s() + (5.0 if fut.running() else 0.0):
                    raise self._give_up(key, fut, spec, waited)
                return None
            try:
                value = fut.result()
            except CancelledError:
                raise GrammarBusy("The schema waited too long for a compile slot; retry shortly.",
                                  _blame(spec)) from None
        if isinstance(value, GrammarError):
            raise value
        return value

    def factory(self, compiled) -> Callable[[], GrammarConstraint]:
        backend = self.backend
        return lambda: backend.constraint(compiled)


def compiler_for_checkpoint(path, tokenizer) -> GrammarCompiler:
    """A compiler for the model at ``path`` (a Hugging Face checkpoint directory): the vocabulary
    size of its config, which may exceed the tokenizer's, and its end-of-sequence ids."""
    from pathlib import Path

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    eos = config.get("eos_token_id")
    generation = path / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id", eos)
    stop = [eos] if isinstance(eos, int) else list(eos or [])
    if not stop and tokenizer.eos_token_id is not None:
        stop = [tokenizer.eos_token_id]
    return GrammarCompiler(tokenizer, config.get("vocab_size") or len(tokenizer), stop)
