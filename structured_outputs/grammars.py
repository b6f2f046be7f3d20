"""Structured output: the grammar a request's answer must match, compiled with xgrammar.

Ingress compiles a request's schema before it queues the request, so a schema that is invalid,
too large or too slow to compile is a 400 before any GPU time is spent; the worker compiles it
again (its own cache, usually a hit) and gives the engine one matcher per choice. Both key their
caches by the spec's canonical JSON, so a repeated schema compiles once per process.

A spec is what travels in ``InferenceRequested.response_format`` (JSON text):
``{"type": "json_object"}`` or ``{"type": "json_schema", "schema": {...}, "strict": bool}``.
Why xgrammar and not llguidance: docs/structured_outputs.md (measured on this CPU).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from structured_outputs.schema_limits import SchemaLimits, SchemaTooCostly, check_schema


def max_schema_bytes() -> int:
    return int(os.environ.get("TOKENMILL_MAX_SCHEMA_BYTES") or 64 * 1024)


def compile_timeout_s() -> float:
    return float(os.environ.get("TOKENMILL_GRAMMAR_COMPILE_TIMEOUT_S") or 5.0)


def compile_processes() -> int:
    """Compile processes per model (each a killable xgrammar compile, structured_outputs/compile_pool.py)."""
    return max(1, int(os.environ.get("TOKENMILL_GRAMMAR_COMPILE_PROCESSES") or 2))


def warm_at_start() -> bool:
    """Whether a worker starts its compile processes when it starts rather than at its first
    structured-output request (which would wait for them)."""
    return (os.environ.get("TOKENMILL_GRAMMAR_WARM") or "1") != "0"


def queue_wait_s() -> float:
    """How long a compile may wait for a slot before the request is answered busy (503)."""
    return float(os.environ.get("TOKENMILL_GRAMMAR_QUEUE_WAIT_S") or 5.0)


def max_compiles_per_tenant() -> int:
    """Compiles one tenant may have waiting or running at once (more: 503 for that tenant only)."""
    return int(os.environ.get("TOKENMILL_GRAMMAR_COMPILES_PER_TENANT") or 8)


STARTUP_WAIT_S = 300.0  # a first compile waits this long for a compile process to come up


class GrammarError(ValueError):
    """A spec that cannot be compiled; ``param`` names the request field to blame."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param
        self.expires_at: float | None = None  # a refusal remembered only until then (monotonic), if set


class GrammarBusy(GrammarError):
    """Too many schemas are compiling already: try again shortly (not the spec's fault)."""


MAX_WAITING_COMPILES = 64
# How long a compile stopped at its time limit is answered from the cache before the schema is tried again.
OVERRUN_REMEMBERED_S = 300.0


def _blame(spec: dict[str, Any]) -> str:
    """The request field a spec's size or compile time is charged to."""
    return "tools" if spec.get("type") == "tool_calls" else "response_format.json_schema.schema"


# xgrammar 0.2.9 lets two kinds of characters into a JSON string that are not JSON: a raw control
# character (U+0001..U+001F; RFC 8259 wants them escaped) in a length-limited string, whose
# characters it spells [^"\\\r\n], and, in every string, a UTF-16 surrogate encoded in UTF-8 (not
# valid UTF-8 at all). A random model picks both. The grammar text is patched before compiling.
_STRING_CHAR_CLASSES = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


def json_strings_only(ebnf: str) -> str:
    for loose in _STRING_CHAR_CLASSES:
        ebnf = ebnf.replace(loose, _JSON_STRING_CHAR)
    return ebnf


# Keywords xgrammar 0.2.9 accepts without enforcing them (it compiles the schema as if they were
# absent), so an answer could break them: refused, by path, rather than silently not kept. So are an
# allOf or a oneOf of more than one part (use anyOf for a union).
UNENFORCED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "contains",
    "minContains", "maxContains", "uniqueItems", "unevaluatedProperties", "unevaluatedItems", "multipleOf"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")


def unenforced_keyword(schema, path: str = "#") -> str | None:
    """The path of the first keyword in ``schema`` that the grammar would not enforce, or None."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNENFORCED_KEYWORDS and not (key == "uniqueItems" and schema[key] is False):
            return f"{path}/{key}"
        # xgrammar 0.2.9 compiles an allOf of several parts as "any value", and a oneOf as an anyOf
        # (an answer could match two branches): only a single part is kept exactly
        if key in ("allOf", "oneOf") and isinstance(schema[key], list) and len(schema[key]) > 1:
            return f"{path}/{key}"
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            found = unenforced_keyword(sub, f"{path}/{key}/{name}")
            if found:
                return found
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []) if isinstance(schema.get(key), list) else ():
            found = unenforced_keyword(sub, f"{path}/{key}/{i}")
            if found:
                return found
    for key in _SCHEMA_VALUES:
        found = unenforced_keyword(schema.get(key), f"{path}/{key}")
        if found:
            return found
    return None


def _hoisted(schema: dict, prefix: str) -> tuple[dict, dict]:
    """A tool's parameters with its own ``$defs`` (or ``definitions``) lifted out under prefixed names
    and its ``$ref``s rewritten to match, so it can sit inside the combined tool-call schema. A ``"#"``
    (the tool's own root, for recursion) becomes a definition of its own."""
    local = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    root_name = f"{prefix}root"

    def rewrite(node):
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str):
                    if v == "#":
                        v = f"#/$defs/{root_name}"
                    else:
                        for base in ("#/$defs/", "#/definitions/"):
                            if v.startswith(base):
                                v = f"#/$defs/{prefix}{v[len(base):]}"
                out[k] = v
            return {k: rewrite(v) if k != "$ref" else v for k, v in out.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    body = rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
    defs = {f"{prefix}{name}": rewrite(sub) for name, sub in local.items()}
    if _refers_to_root(schema):
        defs[root_name] = body
        return {"$ref": f"#/$defs/{root_name}"}, defs
    return body, defs


def _refers_to_root(node) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == "#" or any(_refers_to_root(v) for v in node.values())
    if isinstance(node, list):
        return any(_refers_to_root(v) for v in node)
    return False


def _xgrammar_message(exc: Exception) -> str:
    """xgrammar's message without its log prefix (time, C++ source file and line)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", text)


def spec_key(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class GrammarConstraint:
    """One choice's matcher, as the engine's TokenConstraint protocol asks for it. A matcher that
    fails ends only its own sequence (accept answers False), never the batch."""

    __slots__ = ("matcher", "failed")

    def __init__(self, matcher):
        self.matcher = matcher
        self.failed = False

    def fill_bitmask(self, bitmask, row: int) -> None:
        try:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        except Exception:  # noqa: BLE001 - the row stays unconstrained; accept() then ends it
            self.failed = True

    def accept(self, token_id: int) -> bool:
        if self.failed:
            return False
        try:
            return bool(self.matcher.accept_token(token_id))
        except Exception:  # noqa: BLE001
            self.failed = True
            return False

    def is_complete(self) -> bool:
        return self.matcher.is_terminated()


def compile_spec(xgr, compiler, spec: dict[str, Any]):
    """Compile one spec with xgrammar's ``compiler`` (in a compile process, structured_outputs/compile_child.py);
    GrammarError if it is bad."""
    kind = spec.get("type")
    if kind in ("json_object", "json_schema"):
        # json_object is OpenAI's "any JSON object": an object at the top, anything inside
        schema = spec["schema"] if kind == "json_schema" else {"type": "object"}
        keyword = unenforced_keyword(schema)
        if keyword:
            raise GrammarError(f"Unsupported JSON schema keyword at {keyword}: structured output cannot "
                               f"enforce it.", "response_format.json_schema.schema")
        try:
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                   strict_mode=bool(spec.get("strict", True)))
            return compiler.compile_grammar(json_strings_only(str(grammar)))
        except Exception as exc:  # xgrammar names the keyword or the path it could not use
            raise GrammarError(f"Invalid or unsupported JSON schema: {_xgrammar_message(exc)}",
                               "response_format.json_schema.schema") from None
    if kind == "tool_calls":
        ebnf = _tool_call_grammar(xgr, spec)
        try:
            return compiler.compile_grammar(ebnf)
        except Exception as exc:
            raise GrammarError(f"Invalid or unsupported JSON schema in tools: {_xgrammar_message(exc)}",
                               "tools") from None
    raise GrammarError(f"Unknown response_format type {kind!r}.", "response_format.type")


def _tool_call_grammar(xgr, spec: dict[str, Any]) -> str:
    """One or more (with ``parallel``) ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    blocks, each naming one of the tools with arguments that match its parameters; in ``auto``
    mode, alternatively any text that does not start with "<"."""
    calls, defs = [], {}
    for i, tool in enumerate(spec["tools"]):
        index = tool.get("index", i)
        keyword = unenforced_keyword(tool["parameters"])
        if keyword:
            raise GrammarError(f"Unsupported JSON schema keyword at {keyword} in the parameters of "
                               f"'{tool['name']}': structured output cannot enforce it.",
                               f"tools.{index}.function.parameters")
        arguments, tool_defs = _hoisted(tool["parameters"], f"tool{index}_")
        defs.update(tool_defs)
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": tool["name"]}, "arguments": arguments}})
    schema = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
    if defs:
        schema["$defs"] = defs
    try:
        body = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
    except Exception as exc:
        raise GrammarError(f"Invalid or unsupported JSON schema in tools: {_xgrammar_message(exc)}",
                           "tools") from None
    body = re.sub(r"^root ::=", "tool_call_body ::=", body, flags=re.M)
    one = '("<tool_call>" tool_call_body "</tool_call>")'
    root = f"root ::= {one}+" if spec.get("parallel") else f"root ::= {one}"
    if spec.get("mode") == "auto":
        root = f"root ::= {one}{'+' if spec.get('parallel') else ''} | free_text\nfree_text ::= [^<] [^\\0]*"
    return json_strings_only(root + "\n" + body)


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
        import xgrammar

        from structured_outputs.compile_pool import CompilePool

        self._xgr = xgrammar
        self._info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                             stop_token_ids=list(stop_token_ids))
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self._compiling: dict[str, tuple[Future, str]] = {}  # key -> (future, tenant that asked first)
        self._asked_at: dict[str, float] = {}  # key -> when ready() first waited for it
        self.limits = limits or SchemaLimits()
        self._limit_s = limit_s
        self.processes = processes or compile_processes()
        self.pool = CompilePool(self._info.serialize_json(), self.processes, self.limit_s, self._finish)

    def limit_s(self) -> float:
        """How long one compile may run before its process is killed."""
        return self._limit_s if self._limit_s is not None else compile_timeout_s()

    def close(self) -> None:
        self.pool.close()

    def compile_uncached(self, spec: dict[str, Any]):
        """Compile here, in this process, with no cache, no limit and no pool: for benchmarks
        (tokenmill bench structured measures a first compile with it), never for requests."""
        if getattr(self, "_local", None) is None:
            self._local = self._xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        return compile_spec(self._xgr, self._local, spec)

    def _value_of(self, spec: dict[str, Any], reply: dict):
        if "compiled" in reply:
            try:
                return self._xgr.CompiledGrammar.deserialize_json(reply["compiled"], self._info)
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
        xgr = self._xgr
        return lambda: GrammarConstraint(xgr.GrammarMatcher(compiled))


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
