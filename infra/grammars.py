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
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable


def max_schema_bytes() -> int:
    return int(os.environ.get("TOKENMILL_MAX_SCHEMA_BYTES") or 64 * 1024)


def compile_timeout_s() -> float:
    return float(os.environ.get("TOKENMILL_GRAMMAR_COMPILE_TIMEOUT_S") or 5.0)


class GrammarError(ValueError):
    """A spec that cannot be compiled; ``param`` names the request field to blame."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


class GrammarBusy(GrammarError):
    """Too many schemas are compiling already: try again shortly (not the spec's fault)."""


MAX_WAITING_COMPILES = 64


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


class GrammarCompiler:
    """Compiles specs for one tokenizer, caches the results, and makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_entries: int = 256,
                 threads: int = 1):
        import xgrammar

        self._xgr = xgrammar
        self._info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                             stop_token_ids=list(stop_token_ids))
        # xgrammar's own cache is off: ours is bounded by entries and also remembers failures
        self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._compiling: dict[str, Future] = {}

    def _compile_now(self, spec: dict[str, Any]):
        kind = spec.get("type")
        if kind in ("json_object", "json_schema"):
            # json_object is OpenAI's "any JSON object": an object at the top, anything inside
            schema = spec["schema"] if kind == "json_schema" else {"type": "object"}
            keyword = unenforced_keyword(schema)
            if keyword:
                raise GrammarError(f"Unsupported JSON schema keyword at {keyword}: structured output cannot "
                                   f"enforce it.", "response_format.json_schema.schema")
            try:
                grammar = self._xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                             strict_mode=bool(spec.get("strict", True)))
                return self._compiler.compile_grammar(json_strings_only(str(grammar)))
            except Exception as exc:  # xgrammar names the keyword or the path it could not use
                raise GrammarError(f"Invalid or unsupported JSON schema: {_xgrammar_message(exc)}",
                                   "response_format.json_schema.schema") from None
        if kind == "tool_calls":
            ebnf = self._tool_call_grammar(spec)
            try:
                return self._compiler.compile_grammar(ebnf)
            except Exception as exc:
                raise GrammarError(f"Invalid or unsupported JSON schema in tools: {_xgrammar_message(exc)}",
                                   "tools") from None
        raise GrammarError(f"Unknown response_format type {kind!r}.", "response_format.type")

    def _tool_call_grammar(self, spec: dict[str, Any]) -> str:
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
            body = str(self._xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
        except Exception as exc:
            raise GrammarError(f"Invalid or unsupported JSON schema in tools: {_xgrammar_message(exc)}",
                               "tools") from None
        body = re.sub(r"^root ::=", "tool_call_body ::=", body, flags=re.M)
        one = '("<tool_call>" tool_call_body "</tool_call>")'
        root = f"root ::= {one}+" if spec.get("parallel") else f"root ::= {one}"
        if spec.get("mode") == "auto":
            root = f"root ::= {one}{'+' if spec.get('parallel') else ''} | free_text\nfree_text ::= [^<] [^\\0]*"
        return json_strings_only(root + "\n" + body)

    def _cached(self, key: str):
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _store(self, key: str, value) -> None:
        with self._lock:
            self._cache[key] = value
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)

    def _compile_and_store(self, key: str, spec: dict[str, Any]):
        try:
            try:
                value = self._compile_now(spec)
            except GrammarError as exc:
                value = exc
            except Exception as exc:  # noqa: BLE001 - any failure is this spec's, remembered like one
                value = GrammarError(f"The schema could not be compiled: {type(exc).__name__}: {exc}",
                                     _blame(spec))
            self._store(key, value)
            return value
        finally:
            with self._lock:
                self._compiling.pop(key, None)

    def _future(self, key: str, spec: dict[str, Any]) -> Future:
        with self._lock:
            fut = self._compiling.get(key)
            if fut is None:
                if len(self._compiling) >= MAX_WAITING_COMPILES:
                    raise GrammarBusy("Too many schemas are being compiled right now; retry shortly.", _blame(spec))
                fut = self._compiling[key] = self._pool.submit(self._compile_and_store, key, spec)
            return fut

    def compile(self, spec: dict[str, Any], timeout_s: float | None = None):
        """The compiled grammar; GrammarError if the spec is bad, too large or too slow to compile."""
        size = len(json.dumps(spec))
        if size > max_schema_bytes():
            raise GrammarError(f"The schema is {size} bytes; the limit is {max_schema_bytes()} "
                               f"(TOKENMILL_MAX_SCHEMA_BYTES).", _blame(spec))
        key = spec_key(spec)
        value = self._cached(key)
        if value is None:
            timeout_s = compile_timeout_s() if timeout_s is None else timeout_s
            try:
                value = self._future(key, spec).result(timeout=timeout_s)
            except FutureTimeout:
                raise GrammarError(f"The schema did not compile within {timeout_s:g} s "
                                   f"(TOKENMILL_GRAMMAR_COMPILE_TIMEOUT_S).", _blame(spec)) from None
        if isinstance(value, GrammarError):
            raise value
        return value

    def ready(self, spec: dict[str, Any]):
        """The compiled grammar if it is ready, else None (compiling goes on in the background), so a
        worker never compiles on its step loop. Raises GrammarError for a bad spec."""
        key = spec_key(spec)
        value = self._cached(key)
        if value is None:
            self._future(key, spec)
            return None
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
