"""Sampling: seeded determinism across batches, filters, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_consumers.engine import Engine, SamplingParams
from gpu_consumers.engine.core.sampler import Sampler
from gpu_consumers.engine.core.sequence import Sequence


def _gen(engine, prompt, params, rid="x"):
    return engine.generate([prompt], params)[0]


def test_seeded_same_alone_and_in_crowded_batch(model_dirs):
    path = model_dirs["llama-gqa-rope3"]
    prompt = list(range(20, 45))
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = Engine.from_pretrained(path, num_kv_blocks=256, block_size=8)
    solo = _gen(alone, prompt, params).token_ids

    crowded = Engine.from_pretrained(path, num_kv_blocks=256, block_size=8, max_num_batched_tokens=40, max_num_seqs=12)
    g = torch.Generator().manual_seed(3)
    for i in range(10):
        other = torch.randint(3, 512, (int(torch.randint(2, 60, (1,), generator=g)),), generator=g).tolist()
        crowded.add_request(f"o{i}", other, SamplingParams(max_tokens=30, temperature=0.8 if i % 2 else 0.0,
                                                           seed=i if i % 3 == 0 else None, ignore_eos=True))
    # let the crowd get going, then add ours mid-flight (it joins a mixed prefill/decode batch)
    for _ in range(3):
        crowded.step()
    crowded.add_request("mine", prompt, params)
    got = []
    while crowded.has_unfinished_requests():
        for o in crowded.step():
            if o.request_id == "mine":
                got += o.new_token_ids
    assert got == solo
    # and a different seed gives a different continuation
    other = _gen(alone, prompt, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=99,
                                               ignore_eos=True)).token_ids
    assert other != solo


def test_unseeded_sampling_varies_and_top_k1_is_greedy(model_dirs):
    engine = Engine.from_pretrained(model_dirs["qwen2-bias"], num_kv_blocks=256, block_size=8)
    prompt = list(range(40, 52))
    greedy = _gen(engine, prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).token_ids
    topk1 = _gen(engine, prompt, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True)).token_ids
    assert topk1 == greedy
    tiny_p = _gen(engine, prompt, SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, ignore_eos=True)).token_ids
    assert tiny_p == greedy
    samples = {tuple(_gen(engine, prompt, SamplingParams(max_tokens=12, temperature=2.0, ignore_eos=True)).token_ids)
               for _ in range(4)}
    assert len(samples) > 1


def _seq(params, tokens, n_prompt):
    s = Sequence("r", 0, tokens[:n_prompt], params, None, 0.0)
    for t in tokens[n_prompt:]:
        s.append_token(t)
    return s


def test_penalties_and_filters_unit():
    sampler = Sampler()
    V = 6
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0, -3.0]])
    # repetition penalty: positive logits divided, negative multiplied (tokens 0 and 2 seen)
    s = _seq(SamplingParams(temperature=0, repetition_penalty=4.0), [0, 2], 1)
    row = logits[0].clone()
    Sampler._apply_penalties(row, s)
    assert row.tolist() == pytest.approx([0.5, 1.0, -4.0, 0.5, 0.0, -3.0])
    toks, _ = sampler(logits.clone(), [s])
    assert toks == [1]  # token 0 demoted below token 1
    # presence + frequency over generated tokens only (prompt token 1 not counted)
    s = _seq(SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5), [1, 0, 0, 3], 1)
    row = logits[0].clone()
    Sampler._apply_penalties(row, s)
    assert row.tolist() == pytest.approx([2.0 - 1.0 - 1.0, 1.0, -1.0, 0.5 - 1.5, 0.0, -3.0])
    # min_p: only tokens with p >= min_p * p_max can be drawn
    s = _seq(SamplingParams(temperature=1.0, min_p=0.5, seed=0), [4], 1)
    for _ in range(20):
        toks, _ = sampler(logits.clone(), [s])
        assert toks[0] == 0  # p1/p0 = e^-1 < 0.5
    # top_k=2 samples only from the 2 best
    s = _seq(SamplingParams(temperature=5.0, top_k=2, seed=1), [4], 1)
    seen = {sampler(logits.clone(), [s])[0][0] for _ in range(60)}
    assert seen == {0, 1}
    # top_p=0.75: smallest set with mass >= 0.75
    probs = logits.softmax(-1)[0]
    assert probs[0] < 0.75 < probs[0] + probs[1]
    s = _seq(SamplingParams(temperature=1.0, top_p=0.75, seed=2), [4], 1)
    seen = {sampler(logits.clone(), [s])[0][0] for _ in range(80)}
    assert seen == {0, 1}
    # mixing greedy and sampled rows in one batch
    sg = _seq(SamplingParams(temperature=0), [4], 1)
    toks, _ = sampler(torch.cat([logits, logits.flip(1)]), [sg, _seq(SamplingParams(temperature=0), [4], 1)])
    assert toks == [0, V - 1]


def test_sampling_distribution_roughly_matches_softmax():
    sampler = Sampler()
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    s = _seq(SamplingParams(temperature=1.0, seed=5), [0], 1)
    N = 3000
    counts = torch.zeros(4)
    for _ in range(N):
        counts[sampler(logits.clone(), [s])[0][0]] += 1
    expected = logits.softmax(-1)[0] * N
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5), (counts, expected)


def test_logprobs(model_dirs):
    engine = Engine.from_pretrained(model_dirs["llama-tied"], num_kv_blocks=128, block_size=8)
    r = _gen(engine, list(range(3, 13)), SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))
    lps = r.choices[0].logprobs
    assert len(lps) == 5
    for tok, entry in zip(r.token_ids, lps):
        assert tok in entry
        assert len(entry) == 3  # greedy token is the top-1, so 3 distinct entries
        assert entry[tok] == max(entry.values())
        assert all(v <= 0 for v in entry.values())
        assert sum(math.exp(v) for v in entry.values()) <= 1.0 + 1e-5
    # sampled token with logprobs=0 -> just its own logprob
    r = _gen(engine, list(range(3, 13)), SamplingParams(max_tokens=3, temperature=1.0, seed=0, logprobs=0,
                                                        ignore_eos=True))
    assert all(list(e) == [t] for t, e in zip(r.token_ids, r.choices[0].logprobs))


def test_n_greater_than_one_shares_prompt_blocks(model_dirs):
    engine = Engine.from_pretrained(model_dirs["llama-gqa-rope3"], num_kv_blocks=128, block_size=4,
                                    enable_prefix_caching=False)
    prompt = list(range(3, 33))  # 30 tokens: 7 full blocks + partial
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42, n=3, ignore_eos=True)
    engine.add_request("r", prompt, params)
    max_shared = 0
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        max_shared = max(max_shared, max(engine.kv.pool.ref_cnt))
        if engine.requests:
            used = engine.num_total_blocks - engine.num_free_blocks()
            # three choices of 30+10 tokens would take 30 blocks without sharing
            assert used <= 8 + 3 * 4
    assert max_shared == 3
    by_choice = {i: [t for o in outs if o.choice_index == i for t in o.new_token_ids] for i in range(3)}
    assert all(len(v) == 10 for v in by_choice.values())
    assert len({tuple(v) for v in by_choice.values()}) > 1
    # choice 0 of a seeded n=3 request equals the n=1 request with the same seed
    single = _gen(engine, prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True))
    assert single.token_ids == by_choice[0]
    # greedy n=2: both choices equal greedy
    res = _gen(engine, prompt, SamplingParams(max_tokens=6, temperature=0, n=2, ignore_eos=True))
    assert res.choices[0].token_ids == res.choices[1].token_ids
    assert engine.num_free_blocks() == engine.num_total_blocks


@pytest.mark.parametrize("params", [{"temperature": 1.0, "repetition_penalty": 2.2e-309, "seed": 0},
                                    {"temperature": 1e-300, "seed": 0}],
                         ids=["tiny repetition penalty", "tiny temperature"])
def test_divisors_below_float32_range_keep_the_logits_finite(params):
    """Found by the API fuzz: float32(2.2e-309) is 0, so dividing by it made the logits inf and the softmax NaN,
    and a constrained request then sampled a token its grammar forbids."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0, -3.0]])
    s = _seq(SamplingParams(**params), [0, 2], 1)
    row = logits[0].clone()
    Sampler._apply_penalties(row, s)
    assert torch.isfinite(row).all(), row
    allowed = logits.clone()
    allowed[0, [0, 1]] = float("-inf")  # a grammar's mask: tokens 0 and 1 are forbidden here
    for _ in range(10):
        toks, _ = Sampler()(allowed.clone(), [s])
        assert toks[0] not in (0, 1)
