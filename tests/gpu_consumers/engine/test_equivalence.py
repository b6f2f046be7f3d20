"""Greedy output must be token-identical to transformers generate(do_sample=False)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_consumers.engine import Engine, SamplingParams
from gpu_consumers.engine.layers import onednn

from engine_test_models import MODEL_KINDS

MAX_NEW = 16


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, vocab, (37,), generator=g).tolist()
    out = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 6, 23, 50, 71)]
    # shared prefixes (prefix-cache hits once the first is computed)
    out += [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (2, 9, 16)]
    out.append(list(shared))
    return out


_REF_CACHE: dict[str, list[list[int]]] = {}


def _reference(path: str, prompts) -> list[list[int]]:
    if path not in _REF_CACHE:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        refs = []
        with torch.no_grad():
            for p in prompts:
                out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                  do_sample=False, pad_token_id=0)
                refs.append(out[0, len(p):].tolist())
        _REF_CACHE[path] = refs
    return _REF_CACHE[path]


def _run(engine: Engine, prompts, waves: int = 1):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    results = [None] * len(prompts)
    # wave 1 runs first so later waves can hit the prefix cache
    idx = list(range(len(prompts)))
    groups = [idx[: len(idx) // 2], idx[len(idx) // 2:]] if waves == 2 else [idx]
    for grp in groups:
        res = engine.generate([prompts[i] for i in grp], params)
        for i, r in zip(grp, res):
            results[i] = r
    return results


CONFIGS = {
    # everything fits, big batches: plain continuous batching + prefix hits inside the batch
    "roomy": dict(num_kv_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=512),
    # token budget smaller than most prompts: chunked prefill interleaved with decodes
    "chunked": dict(num_kv_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=13),
    # tiny KV pool: forces preemption + recompute
    "preempt": dict(num_kv_blocks=30, block_size=4, max_num_seqs=8, max_num_batched_tokens=64),
    # prefix caching off
    "no-prefix": dict(num_kv_blocks=256, block_size=8, max_num_seqs=6, max_num_batched_tokens=32,
                      enable_prefix_caching=False),
}


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers(model_dirs, kind, config):
    path = model_dirs[kind]
    engine = Engine.from_pretrained(path, **CONFIGS[config])
    prompts = _prompts(engine.model.cfg.vocab_size)
    refs = _reference(path, prompts)
    results = _run(engine, prompts, waves=2 if config in ("chunked", "preempt") else 1)
    for p, r, ref in zip(prompts, results, refs):
        assert r.token_ids == ref, f"prompt len {len(p)}: engine {r.token_ids} != transformers {ref}"
        assert r.finish_reason == "length"
    st = engine.stats
    if config == "preempt":
        assert st["preemptions"] > 0
    if config == "chunked":
        assert st["prefix_cache_hits"] > 0  # second wave reuses the shared 37-token prefix
    if config == "no-prefix":
        assert st["prefix_cache_hits"] == 0
    # all blocks back in the pool
    assert engine.num_free_blocks() == engine.num_total_blocks
    engine.kv.pool.check_invariants()


def test_engine_internals_model_types(model_dirs):
    """The three fixtures really cover GQA+llama3 rope, qkv bias, tied embeddings."""
    e1 = Engine.from_pretrained(model_dirs["llama-gqa-rope3"], num_kv_blocks=8)
    assert e1.model.cfg.num_kv_heads < e1.model.cfg.num_heads
    assert e1.model.cfg.rope_scaling["rope_type"] == "llama3"
    e2 = Engine.from_pretrained(model_dirs["qwen2-bias"], num_kv_blocks=8)
    assert e2.model.layers[0].qkv.bias is not None
    e3 = Engine.from_pretrained(model_dirs["llama-tied"], num_kv_blocks=8)
    assert e3.model.tied_lm_head
    assert torch.equal(onednn.plain(e3.model.lm_head.weight), e3.model.embed)  # packed for oneDNN, or the same tensor


def test_mistral_matches_transformers(tmp_path):
    from engine_test_models import build_model

    path = build_model("mistral", str(tmp_path / "mistral"))
    engine = Engine.from_pretrained(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=24, max_num_seqs=4)
    prompts = _prompts(engine.model.cfg.vocab_size)[:5]
    refs = _reference(path, prompts)
    res = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    assert [r.token_ids for r in res] == refs
