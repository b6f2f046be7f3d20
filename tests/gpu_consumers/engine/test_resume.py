"""A request preempted on one engine and resumed on another continues token for token and
character for character, with penalties, stop strings and seeded sampling intact."""
from __future__ import annotations

import pytest

from gpu_consumers.engine import Engine, SamplingParams


def _stream(engine, rid, steps=None, start=0):
    """(token ids, text) produced for `rid`, stepping at most `steps` times."""
    tokens, text = [], ""
    n = 0
    while engine.has_unfinished_requests() and (steps is None or n < steps):
        for out in engine.step():
            if out.request_id == rid:
                assert out.first_token_index == start + len(tokens)
                tokens += out.new_token_ids
                text += out.text_delta
        n += 1
    return tokens, text


PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=77, ignore_eos=True,
                   presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=["lazy dog"]),
    SamplingParams(max_tokens=40, temperature=1.2, top_k=20, seed=5, ignore_eos=True, stop=["é"]),
]


@pytest.mark.parametrize("params", PARAMS, ids=["seeded+penalties", "greedy+stop", "seeded+stop"])
@pytest.mark.parametrize("cut", [2, 9])
def test_resumed_request_continues_identically(tok_model_dir, params, cut):
    prompt = [5, 17, 42, 99, 130, 7, 250]
    whole = Engine.from_pretrained(tok_model_dir, num_kv_blocks=256, block_size=8)
    whole.add_request("r", prompt, params)
    expected_tokens, expected_text = _stream(whole, "r")

    first = Engine.from_pretrained(tok_model_dir, num_kv_blocks=256, block_size=8)
    first.add_request("r", prompt, params)
    head_tokens, head_text = _stream(first, "r", steps=cut)
    assert len(head_tokens) < len(expected_tokens), "the request ended before the cut: nothing would be resumed"
    assert first.output_token_ids("r") == head_tokens
    first.abort("r")
    assert first.num_free_slots() == first.max_num_seqs

    second = Engine.from_pretrained(tok_model_dir, num_kv_blocks=256, block_size=8)
    second.add_request("other", [3, 4, 5], SamplingParams(max_tokens=5, temperature=0.7, seed=1))
    second.add_request("r", prompt, params, resume_token_ids=head_tokens, resume_text_chars=len(head_text))
    tail_tokens, tail_text = _stream(second, "r", start=len(head_tokens))
    assert head_tokens + tail_tokens == expected_tokens
    assert head_text + tail_text == expected_text


def test_resume_refuses_what_cannot_continue(tok_model_dir):
    engine = Engine.from_pretrained(tok_model_dir, num_kv_blocks=256, block_size=8)
    with pytest.raises(ValueError):
        engine.add_request("a", [1, 2], SamplingParams(max_tokens=3), resume_token_ids=[5, 6, 7])
    with pytest.raises(ValueError):
        engine.add_request("b", [1, 2], SamplingParams(max_tokens=8, n=2), resume_token_ids=[5])
    with pytest.raises(ValueError):
        engine.add_request("c", [1, 2], SamplingParams(max_tokens=8), resume_token_ids=[10**6])
