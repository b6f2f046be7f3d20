"""The xgrammar backend of structured outputs: a spec (a JSON schema, any JSON object, or tool calls) to a
compiled grammar, and a compiled grammar to the matcher the engine's TokenConstraint protocol asks for.

Everything that knows xgrammar is here: its tokenizer description (made once in the process that has the
tokenizer, sent as JSON to the compile processes), its compile, its serialised form, and what xgrammar 0.2.9
accepts but does not enforce (refused by path) or lets through that is not JSON (patched). The compile
cache, the cost limits and the compile processes around it know only the backend interface
(structured_outputs/backend.py). Why xgrammar and not llguidance: docs/structured_outputs.md.
"""
from __future__ import annotations

import json
import re
from typing import Any

from structured_outputs.errors import GrammarError


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


class XgrammarBackend:
    """One tokenizer's grammars with xgrammar (the library is imported when one is made, never before)."""

    name = "xgrammar"

    def __init__(self, tokenizer_info_json: str):
        import xgrammar

        self._xgr = xgrammar
        self._info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
        self._compiler = None

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> "XgrammarBackend":
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        return cls(info.serialize_json())

    def tokenizer_json(self) -> str:
        return self._info.serialize_json()

    def compile(self, spec: dict[str, Any]):
        """Compile in this process, with no cache and no limit: what a compile process runs (and a benchmark);
        GrammarError if the spec is bad."""
        if self._compiler is None:
            self._compiler = self._xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        return compile_spec(self._xgr, self._compiler, spec)

    def serialize(self, compiled) -> str:
        return compiled.serialize_json()

    def deserialize(self, text: str):
        return self._xgr.CompiledGrammar.deserialize_json(text, self._info)

    def constraint(self, compiled) -> GrammarConstraint:
        return GrammarConstraint(self._xgr.GrammarMatcher(compiled))


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
    schema: dict[str, Any] = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
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
