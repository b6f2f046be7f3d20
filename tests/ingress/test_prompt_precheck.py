"""A prompt that cannot fit the context is refused before it is tokenized, and never wrongly."""
from __future__ import annotations

import pytest

from ingress.serving.served_model import ServedModel
from infra.config import ModelSpec


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return ServedModel(ModelSpec("tiny", tiny_model_dir))


def test_text_that_cannot_fit_is_known_without_tokenizing(model, monkeypatch):
    huge = "lorem ipsum " * (model.max_model_len * 20)
    monkeypatch.setattr(model.tokenizer, "encode", _never)
    assert model.surely_too_long([huge])


def test_the_bound_never_refuses_a_prompt_that_fits(model):
    # the densest text for this tokenizer: repeat its longest token; still within the context
    longest = max(range(len(model.tokenizer)), key=lambda i: len(model.tokenizer.decode([i]).encode()))
    piece = model.tokenizer.decode([longest])
    text = piece * (model.max_model_len // 2)
    assert len(model.text_prompt(text)) <= model.max_model_len
    assert not model.surely_too_long([text])


def _never(*_args, **_kwargs):
    raise AssertionError("the pre-check tokenized the prompt")
