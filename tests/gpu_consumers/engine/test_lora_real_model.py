"""On the real model (SmolLM2-135M-Instruct), random non-zero LoRA adapters: the engine's greedy tokens
equal PEFT's (unmerged) for chat prompts ended by the model's own EOS, for each adapter alone (a batch of
its own prompts, no other adapter in it) and in one batch that mixes 4 adapters and the base model
(issue 34's correctness target). One engine serves every test: building one costs more than a test."""
from __future__ import annotations

import pytest
from gpu_consumers.engine import Engine, LoraRequest, SamplingParams
from tests.support.chat_prompts import chat_prompts
from tests.support.peft_reference import peft_greedy_each

from test_lora import ALL, make_adapter

pytestmark = pytest.mark.slow

MAX_NEW = 16
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "Write a haiku about the sea.",
             "What does CPU stand for?"]
# (seed, r, lora_alpha, targets, use_rslora); weights ~ N(0, 0.04^2): the answers change, and stay text
ADAPTERS = {
    "qv": (1, 8, 16, ["q_proj", "v_proj"], False),
    "all-rs": (2, 16, 16, ALL, True),
    "mlp": (3, 4, 8, ["gate_proj", "up_proj", "down_proj"], False),
    "ko": (4, 8, 8, ["k_proj", "o_proj"], False),
}
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(real_model_dir) -> list[list[int]]:
    return chat_prompts(real_model_dir, QUESTIONS)


@pytest.fixture(scope="module")
def adapters(real_model_dir, tmp_path_factory) -> dict[str, LoraRequest]:
    root = tmp_path_factory.mktemp("real-adapters")
    return {name: LoraRequest(f"t/{name}", make_adapter(str(real_model_dir), str(root / name), *spec, std=0.04))
            for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def reference(real_model_dir, adapters, prompts) -> dict[str | None, list[list[int]]]:
    return peft_greedy_each(str(real_model_dir), {None: None, **{name: lr.path for name, lr in adapters.items()}},
                            prompts, MAX_NEW, stop_at_eos=True)


@pytest.fixture(scope="module")
def engine(real_model_dir) -> Engine:
    return Engine.from_pretrained(str(real_model_dir), num_kv_blocks=512, block_size=16, max_num_seqs=32,
                                  max_num_batched_tokens=512, max_lora_rank=16, max_loras=len(ADAPTERS))


def test_adapters_change_the_answers(reference):
    for name in ADAPTERS:
        assert reference[name] != reference[None], name


def test_each_adapter_alone_equals_peft(engine, adapters, reference, prompts):
    seen = _batches_seen(engine)
    for name, lora in adapters.items():
        got = [r.token_ids for r in engine.generate(prompts, GREEDY, lora=lora)]
        assert got == reference[name], name
    assert {len(ids) for ids in seen} == {1}  # never two adapters in one step


def test_one_batch_of_four_adapters_and_the_base_model_equals_peft(engine, adapters, reference, prompts):
    names = [None, *ADAPTERS]
    engine.generate([[1]] * 4, SamplingParams(max_tokens=1), lora=list(adapters.values()))  # all resident
    seen = _batches_seen(engine)
    batch = [(name, i) for i in range(len(prompts)) for name in names]
    results = engine.generate([prompts[i] for _, i in batch], GREEDY,
                              lora=[adapters[name] if name else None for name, _ in batch])
    for (name, i), r in zip(batch, results):
        assert r.token_ids == reference[name][i], (name, QUESTIONS[i])
        assert r.finish_reason == ("stop" if reference[name][i][-1] == 2 else "length")
    assert max(len(s) for s in seen) == 5


def _batches_seen(engine: Engine) -> list[set]:
    """The adapter ids of each step's sequences from now on (this module's engine only)."""
    seen: list[set] = []
    prepare = type(engine.runner).prepare.__get__(engine.runner)
    engine.runner.prepare = lambda seqs, n: seen.append({s.adapter_id for s in seqs}) or prepare(seqs, n)
    return seen
