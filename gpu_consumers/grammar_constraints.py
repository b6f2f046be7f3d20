"""A request's structured-output constraint: its response_format compiled into a grammar off the
step loop, then one matcher per choice."""
from __future__ import annotations

import json
import logging
import threading
from typing import Any

from structured_outputs.grammars import GrammarCompiler, GrammarError
from schemas.records import InferenceRequested

log = logging.getLogger("tokenmill.worker")

COMPILING = object()  # a structured-output request whose grammar is still compiling


class GrammarConstraints:
    def __init__(self, engine: Any):
        self.engine = engine
        self.compiler: GrammarCompiler | None = None  # warmed at start (warm), else made when first asked
        self._warming: threading.Thread | None = None

    def for_request(self, record: InferenceRequested) -> Any:
        """The request's constraint factory, None for free text, or COMPILING while its grammar
        compiles in the background. Raises GrammarError for a spec that cannot be one, GrammarBusy
        when no compile slot came in time."""
        text = record.get("response_format")
        if not text:
            return None
        if self.compiler is None:
            if self._warming is not None and self._warming.is_alive():
                return COMPILING  # the compiler is being made off the step loop
            self.compiler = self.new_compiler()
        try:
            # bounded: a grammar stopped at its compile limit is a GrammarError, one that waits too
            # long for a compile slot a GrammarBusy (structured_outputs/grammars.py), never an endless wait
            compiled = self.compiler.ready(json.loads(text), tenant=record.get("tenant_id"))
        except GrammarError:
            raise
        except ValueError as exc:  # not JSON
            raise GrammarError(str(exc)) from None
        return COMPILING if compiled is None else self.compiler.factory(compiled)

    def new_compiler(self) -> GrammarCompiler:
        return GrammarCompiler(self.engine.tokenizer, self.engine.model.cfg.vocab_size,
                               sorted(self.engine.eos_token_ids))

    def warm(self) -> None:
        """Make the grammar compiler and start its compile processes in the background. Each process
        imports xgrammar and torch (~7 s of CPU on a quiet 2-core machine, far more under load); made
        at the first structured-output request instead, that cost fell on its caller, and the
        compiler's own set-up ran on the step loop, stalling every stream meanwhile."""
        def make() -> None:
            try:
                self.compiler = self.new_compiler()
            except Exception:  # noqa: BLE001 - the first structured request makes it again, and says why
                log.exception("grammar compiler warm-up failed")

        self._warming = threading.Thread(target=make, name="grammar-warmup", daemon=True)
        self._warming.start()

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
