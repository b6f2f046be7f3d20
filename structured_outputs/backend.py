"""What structured outputs need of a grammar library, so that the cache, the limits and the compile processes
(structured_outputs/grammars.py, compile_pool.py, compile_child.py) do not depend on which one compiles.
One implementation per library; xgrammar's is structured_outputs/xgrammar_backend.py."""
from __future__ import annotations

from typing import Any, Protocol


class GrammarBackend(Protocol):
    name: str

    def tokenizer_json(self) -> str:
        """The tokenizer as the library describes it, sent once to each compile process."""

    def compile(self, spec: dict[str, Any]) -> Any:
        """Compile a spec here and now (GrammarError if it is bad); compile processes call it."""

    def serialize(self, compiled: Any) -> str:
        """A compiled grammar as text, to cross from a compile process."""

    def deserialize(self, text: str) -> Any:
        ...

    def constraint(self, compiled: Any) -> Any:
        """A fresh matcher for one choice, as the engine's TokenConstraint protocol asks for it."""
