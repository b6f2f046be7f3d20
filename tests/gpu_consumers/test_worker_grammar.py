"""A worker compiles a request's response_format off its step loop and refuses a bad one."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from gpu_consumers.grammar_constraints import COMPILING, GrammarConstraints
from structured_outputs.grammars import GrammarError


# a first compile starts the worker's compile processes (structured_outputs/compile_pool.py), each importing xgrammar:
# seconds, minutes on a busy machine
START = 300


@pytest.fixture()
def bare_worker(tiny_model_dir):
    w = GrammarConstraints(SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                                           model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=2048)),
                                           eos_token_ids={2, 3}))
    yield w
    w.close()


def test_a_new_schema_compiles_in_the_background_then_gives_a_matcher_per_choice(bare_worker):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    record = {"response_format": json.dumps({"type": "json_schema", "schema": schema, "strict": True})}
    assert bare_worker.for_request(record) is COMPILING  # the step loop does not wait
    deadline = time.monotonic() + START
    factory = bare_worker.for_request(record)
    while factory is COMPILING and time.monotonic() < deadline:
        time.sleep(0.01)
        factory = bare_worker.for_request(record)
    first, second = factory(), factory()
    tokens = bare_worker.engine.tokenizer.encode('{"ok": true}', add_special_tokens=False)
    assert all(first.accept(t) for t in tokens)
    assert first.accept(2) and first.is_complete()  # the end of sequence closes a whole answer
    assert not second.is_complete() and second.accept(tokens[0])  # each choice starts from the beginning
    assert not second.accept(2)  # and cannot end before its JSON is whole
    assert bare_worker.for_request({"response_format": None}) is None


def test_a_bad_spec_is_a_grammar_error_for_that_request(bare_worker):
    bad = {"response_format": json.dumps({"type": "json_schema", "schema": {"type": "strng"}})}
    deadline = time.monotonic() + START
    with pytest.raises(GrammarError):
        while time.monotonic() < deadline:
            if bare_worker.for_request(bad) is not COMPILING:
                break
            time.sleep(0.01)
    with pytest.raises(GrammarError):
        bare_worker.for_request({"response_format": "{not json"})


def test_a_warmed_worker_makes_its_compiler_off_the_step_loop(bare_worker, monkeypatch):
    made = []
    real = GrammarConstraints.new_compiler

    def slow_compiler(self):
        made.append(time.monotonic())
        time.sleep(0.5)  # a loaded machine's set-up: the step loop must not wait for it
        return real(self)

    monkeypatch.setattr(GrammarConstraints, "new_compiler", slow_compiler)
    bare_worker.warm()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    record = {"response_format": json.dumps({"type": "json_schema", "schema": schema, "strict": True})}
    asked = time.monotonic()
    assert bare_worker.for_request(record) is COMPILING
    assert time.monotonic() - asked < 0.4  # answered while the compiler was still being made
    deadline = time.monotonic() + START
    factory = bare_worker.for_request(record)
    while factory is COMPILING and time.monotonic() < deadline:
        time.sleep(0.01)
        factory = bare_worker.for_request(record)
    assert len(made) == 1  # the warm-up's compiler serves the request; none is made on the step loop
    matcher = factory()
    assert all(matcher.accept(t) for t in bare_worker.engine.tokenizer.encode('{"n": 7}', add_special_tokens=False))
