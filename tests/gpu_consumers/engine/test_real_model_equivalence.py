"""On the real model `make up` serves (SmolLM2-135M-Instruct), the engine's greedy tokens equal
transformers' greedy tokens, token for token, for chat prompts rendered by the model's own chat
template and ended by its own EOS id: alone, in one mixed batch, with chunked prefill, with prefix-cache
hits, under KV pressure that preempts, and resumed on another engine after a preemption.

A random model cannot show this: near-ties between logits are where two correct implementations
part, and a trained model's distributions are shaped nothing like random ones."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpu_consumers.engine import Engine, SamplingParams
from tests.support.chat_prompts import chat_prompts

pytestmark = pytest.mark.slow

MAX_NEW = 16
ALONE = 6  # prompts run one at a time as well (each costs a whole generation)
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Translate 'thank you' into French.",
    "What gas do plants absorb from the air?",
    "Who wrote Romeo and Juliet?",
    "Give me one word that rhymes with cat.",
    "What is the boiling point of water in Celsius?",
    "Say hello in Spanish.",
    "What is the largest planet in the solar system?",
    "Write a haiku about the sea.",
    "List three fruits.",
    "What does CPU stand for?",
    "Explain in one sentence what a database index is.",
    "Is the sun a star? Answer yes or no.",
]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)

CONFIGS = {
    # each prompt on its own
    "alone": dict(num_kv_blocks=64, block_size=16, max_num_seqs=1, max_num_batched_tokens=512),
    # every prompt in one running batch, prefills mixed with decodes, each prompt's system turn read
    # from the prefix cache
    "mixed-batch": dict(num_kv_blocks=512, block_size=16, max_num_seqs=32, max_num_batched_tokens=512),
    # a step budget smaller than any prompt: prompts are prefilled in chunks between decodes
    "chunked-prefill": dict(num_kv_blocks=512, block_size=8, max_num_seqs=8, max_num_batched_tokens=13),
    # a KV pool too small for the batch: sequences are preempted and recomputed
    "kv-pressure": dict(num_kv_blocks=40, block_size=8, max_num_seqs=16, max_num_batched_tokens=64),
}


@pytest.fixture(scope="module")
def prompts(real_model_dir) -> list[list[int]]:
    return chat_prompts(real_model_dir, QUESTIONS)


@pytest.fixture(scope="module")
def reference(real_model_dir, prompts) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time, stopping at the generation config's EOS."""
    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            generated = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)
            out.append(generated[0, len(p):].tolist())
    return out


def _engine(path, config: str) -> Engine:
    return Engine.from_pretrained(str(path), dtype=torch.float32, **CONFIGS[config])


def test_prompts_use_the_chat_template_and_answers_end_on_eos(real_model_dir, prompts, reference):
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(prompts) >= 16
    assert all(tokenizer.decode(p).endswith("<|im_start|>assistant\n") for p in prompts)
    ended = [r for r in reference if r and r[-1] == eos]
    assert 3 <= len(ended) < len(reference)  # both ways to finish are compared: EOS and max_tokens
    assert "Paris" in tokenizer.decode(reference[0])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_transformers(real_model_dir, prompts, reference, config):
    engine = _engine(real_model_dir, config)
    assert engine.eos_token_ids == {2}  # <|im_end|>, from generation_config.json
    if config == "alone":
        prompts, reference = prompts[:ALONE], reference[:ALONE]
        results = [engine.generate([p], GREEDY)[0] for p in prompts]
    elif config == "mixed-batch":
        engine.generate(prompts[:1], SamplingParams(max_tokens=1))  # caches the shared system turn
        results = engine.generate(prompts, GREEDY)
        assert all(r.cached_tokens > 0 for r in results)
    else:
        results = engine.generate(prompts, GREEDY)
    for question, result, expected in zip(QUESTIONS, results, reference):
        assert result.token_ids == expected, f"{question!r}: engine {result.token_ids} != transformers {expected}"
        assert result.finish_reason == ("stop" if expected[-1] == 2 else "length")
    if config == "kv-pressure":
        assert engine.stats["preemptions"] > 0
    assert engine.num_free_blocks() == engine.num_total_blocks


def test_resumed_after_a_preemption_on_another_engine(real_model_dir, prompts, reference):
    """A worker hands a preempted request back with what it generated; another engine continues it."""
    cut = 3
    long_answers = [i for i, r in enumerate(reference) if len(r) > cut + 2][:4]
    first = _engine(real_model_dir, "mixed-batch")
    heads = {i: r.token_ids for i, r in zip(long_answers, first.generate(
        [prompts[i] for i in long_answers], SamplingParams(max_tokens=cut, temperature=0.0)))}
    second = _engine(real_model_dir, "mixed-batch")
    for i in long_answers:
        second.add_request(f"r{i}", prompts[i], GREEDY, resume_token_ids=heads[i])
    tails = {i: [] for i in long_answers}
    while second.has_unfinished_requests():
        for out in second.step():
            tails[int(out.request_id[1:])] += out.new_token_ids
    assert {i: heads[i] + tails[i] for i in long_answers} == {i: reference[i] for i in long_answers}
