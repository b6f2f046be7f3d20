"""The grammar compiler's limits: a full compile queue answers busy, and a compile that fails in an
unexpected way is remembered as that spec's error, never a request stuck waiting."""
import pytest
from transformers import AutoTokenizer

from infra import grammars
from infra.grammars import GrammarBusy, GrammarError, compiler_for_checkpoint

SPEC = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    return compiler_for_checkpoint(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir))


def test_a_full_compile_queue_is_busy_not_a_bad_schema(compiler, monkeypatch):
    monkeypatch.setattr(grammars, "MAX_WAITING_COMPILES", 0)
    with pytest.raises(GrammarBusy):
        compiler.compile(SPEC)
    monkeypatch.setattr(grammars, "MAX_WAITING_COMPILES", 64)
    assert compiler.compile(SPEC) is not None


def test_an_unexpected_compile_failure_is_that_specs_error_and_nothing_stays_queued(compiler, monkeypatch):
    def explode(spec):
        raise RuntimeError("boom")

    monkeypatch.setattr(compiler, "_compile_now", explode)
    spec = {"type": "json_object", "probe": 1}
    with pytest.raises(GrammarError, match="boom"):
        compiler.compile(spec)
    assert compiler._compiling == {}
    with pytest.raises(GrammarError):
        compiler.ready(spec)  # remembered, not compiled again and again
