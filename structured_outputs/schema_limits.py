"""What a structured-output schema may cost, checked before anything compiles it.

A grammar compile's cost is not its size: a 170-byte schema whose one string has the pattern
``^(([a-z]{1,8}){1,8}){1,8}$`` took 37.6 s to compile for SmolLM2's vocabulary, and with
``{1,20}`` it did not finish in 60 s. What makes xgrammar slow is a *bounded repetition of
something that itself repeats* (measured on that vocabulary: ``[a-z]{1,64}`` 0.36 s,
``(ab|cd){1,64}`` 0.1 s, ``([a-z]{1,8}){1,8}`` 3.8 s, ``(([a-z]{1,4}){1,4}){1,4}`` 13.9 s), while the
schema's own bounds (``maxLength``, ``maxItems``, nested arrays) stay cheap. So every regular
expression in a schema (``pattern``, the keys of ``patternProperties``) is parsed with Python's own
regex parser and refused when the product of the upper bounds of its nested repetitions
(an unbounded ``*``/``+`` counting as :data:`UNBOUNDED_FACTOR`) exceeds a bound; so are very deep
schemas, schemas with very many keys or enum values, and very long patterns. What passes here can
still be slow, so the compile itself is also stopped at its time limit (structured_outputs/compile_pool.py).

Every limit is a setting (infra/settings.py); a refusal names the schema path and the limit.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from infra import settings

try:  # Python 3.11+
    import re._parser as _sre_parse  # type: ignore[import-not-found]
    from re._constants import MAXREPEAT as _MAXREPEAT  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - older Pythons
    import sre_parse as _sre_parse  # type: ignore[no-redef]
    from sre_constants import MAXREPEAT as _MAXREPEAT  # type: ignore[no-redef]

UNBOUNDED_FACTOR = 4


@dataclass(frozen=True)
class SchemaLimits:
    max_depth: int = field(default_factory=settings.MAX_SCHEMA_DEPTH.get)
    max_keys: int = field(default_factory=settings.MAX_SCHEMA_KEYS.get)
    max_enum_values: int = field(default_factory=settings.MAX_SCHEMA_ENUM.get)
    max_pattern_chars: int = field(default_factory=settings.MAX_PATTERN_CHARS.get)
    # product of the upper bounds of nested repetitions in one pattern
    max_repeat_product: int = field(default_factory=settings.MAX_PATTERN_REPEAT_PRODUCT.get)
    max_repeat_bound: int = field(default_factory=settings.MAX_PATTERN_REPEAT.get)
    # the sum of that product over one schema's patterns that nest repetitions (a pattern without nested
    # repetitions costs nothing here): twenty patterns each just under the limit compile as long as one far over
    max_repeat_total: int = field(default_factory=settings.MAX_SCHEMA_REPEAT_TOTAL.get)


class SchemaTooCostly(ValueError):
    """``path`` is where in the schema; the message says which limit."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")


def _walk(items, limits: SchemaLimits) -> tuple[int, int]:
    """(chain, worst) of a parsed pattern: ``chain`` is the largest product of the upper bounds of
    variable-length repetitions nested in one another (1 if none), ``worst`` the largest such
    product where a repetition's body itself repeats: the cost this module bounds."""
    chain = worst = 1
    for op, av in items:
        name = str(op)
        parts: list = []
        if name in _REPEATS:
            lo, hi, sub = av
            if hi != _MAXREPEAT and hi > limits.max_repeat_bound:
                raise ValueError(f"a repetition bound of {hi} exceeds {limits.max_repeat_bound} "
                                 f"(TOKENMILL_MAX_PATTERN_REPEAT)")
            c, w = _walk(sub, limits)
            worst = max(worst, w)
            if lo == hi and not _varies(sub):
                chain = max(chain, c)  # a fixed number of fixed-width copies: no ambiguity
                continue
            product = (UNBOUNDED_FACTOR if hi == _MAXREPEAT else max(1, hi)) * c
            chain = max(chain, product)
            if c > 1:  # a repetition of something that repeats
                worst = max(worst, product)
            continue
        if name == "SUBPATTERN":
            parts = [av[-1]]
        elif name == "BRANCH":
            parts = list(av[1])
        elif name in ("ASSERT", "ASSERT_NOT"):
            parts = [av[1]]
        elif name == "GROUPREF_EXISTS":
            parts = [part for part in av[1:] if part is not None]
        for part in parts:
            c, w = _walk(part, limits)
            chain, worst = max(chain, c), max(worst, w)
    return chain, worst


def _varies(items) -> bool:
    """Whether a parsed pattern contains a repetition whose length varies."""
    for op, av in items:
        name = str(op)
        if name in _REPEATS:
            if av[0] != av[1] or _varies(av[2]):
                return True
        elif name == "SUBPATTERN" and _varies(av[-1]):
            return True
        elif name == "BRANCH" and any(_varies(b) for b in av[1]):
            return True
    return False


def pattern_cost(pattern: str, limits: SchemaLimits) -> int:
    """The nested-repetition product of a regular expression; ValueError if it cannot be parsed or
    breaks a limit of its own."""
    if len(pattern) > limits.max_pattern_chars:
        raise ValueError(f"the pattern is {len(pattern)} characters; the limit is {limits.max_pattern_chars} "
                         f"(TOKENMILL_MAX_PATTERN_CHARS)")
    try:
        parsed = _sre_parse.parse(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        raise ValueError(f"the pattern is not a regular expression this server can check: {exc}") from None
    return _walk(list(parsed), limits)[1]


def check_schema(schema: Any, limits: SchemaLimits | None = None) -> None:
    """Raise SchemaTooCostly if compiling ``schema`` could cost more than the limits allow."""
    limits = limits or SchemaLimits()
    keys = 0
    enums = 0
    total = [0]  # the nested-repetition cost of the patterns seen so far
    # an explicit stack, so a deep document cannot exhaust Python's own recursion either
    stack: list[tuple[Any, str, int, bool]] = [(schema, "#", 1, True)]
    while stack:
        node, path, depth, is_schema = stack.pop()
        if depth > limits.max_depth:
            raise SchemaTooCostly(f"The schema is nested more than {limits.max_depth} levels deep "
                                  f"(TOKENMILL_MAX_SCHEMA_DEPTH).", path)
        if isinstance(node, dict):
            keys += len(node)
            if keys > limits.max_keys:
                raise SchemaTooCostly(f"The schema has more than {limits.max_keys} keys "
                                      f"(TOKENMILL_MAX_SCHEMA_KEYS).", path)
            for key, value in node.items():
                sub = f"{path}/{key}"
                if is_schema and key == "pattern" and isinstance(value, str):
                    _check_pattern(value, sub, limits, total)
                elif is_schema and key == "patternProperties" and isinstance(value, dict):
                    for pattern in value:
                        _check_pattern(pattern, f"{sub}/{pattern}", limits, total)
                if is_schema and key in ("enum", "const", "default", "examples"):
                    if key == "enum" and isinstance(value, list):
                        enums += len(value)
                        if enums > limits.max_enum_values:
                            raise SchemaTooCostly(f"The schema has more than {limits.max_enum_values} enum "
                                                  f"values (TOKENMILL_MAX_SCHEMA_ENUM).", sub)
                    stack.append((value, sub, depth + 1, False))
                else:
                    stack.append((value, sub, depth + 1, is_schema))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                stack.append((value, f"{path}/{i}", depth + 1, is_schema))


def _check_pattern(pattern: str, path: str, limits: SchemaLimits, total: list[int]) -> None:
    try:
        cost = pattern_cost(pattern, limits)
    except ValueError as exc:
        raise SchemaTooCostly(f"The pattern at {path} is refused: {exc}.", path) from None
    if cost > 1:
        total[0] += cost
        if total[0] > limits.max_repeat_total and cost <= limits.max_repeat_product:
            raise SchemaTooCostly(
                f"The schema's patterns nest repetitions whose bounds add up to {total[0]} by the one at {path}; "
                f"the limit for a whole schema is {limits.max_repeat_total} (TOKENMILL_MAX_SCHEMA_REPEAT_TOTAL): "
                f"compiling them all could take minutes. Flatten the patterns or use maxLength.", path)
    if cost > limits.max_repeat_product:
        raise SchemaTooCostly(
            f"The pattern at {path} nests repetitions whose bounds multiply to {cost} (an unbounded one "
            f"counts {UNBOUNDED_FACTOR}); the limit is {limits.max_repeat_product} "
            f"(TOKENMILL_MAX_PATTERN_REPEAT_PRODUCT): compiling it could take minutes. Flatten the "
            f"pattern or use maxLength.", path)
