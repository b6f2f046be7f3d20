"""The compiled paged decode attention (reads K/V blocks in place through the block table) against
the SDPA-over-a-gathered-copy path it replaces, and both engine paths against transformers.

The other equivalence tests run the engine's default, which on a CPU is the compiled path; here the
eager path is held to the same token-for-token equality."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_consumers.engine import Engine
from gpu_consumers.engine.model import compiled_decode_attention, paged_decode_attention

from engine_test_models import MODEL_KINDS
from test_equivalence import CONFIGS, _prompts, _reference, _run


def _sdpa_reference(q, kc, vc, bt, lens):
    D, kvh, g, hd = q.shape
    bs = kc.shape[1]
    L = bt.shape[1] * bs
    ks = kc[bt].reshape(D, L, kvh, hd).transpose(1, 2)
    vs = vc[bt].reshape(D, L, kvh, hd).transpose(1, 2)
    mask = (torch.arange(L)[None] < lens[:, None]).view(D, 1, 1, L)
    o = F.scaled_dot_product_attention(q.reshape(D, kvh * g, 1, hd), ks, vs, attn_mask=mask, enable_gqa=g > 1)
    return o.view(D, kvh, g, hd)


@pytest.mark.parametrize("shape", [(1, 1, 1), (5, 2, 3), (16, 3, 1)])  # (D, kv heads, group)
@pytest.mark.parametrize("blocks", [1, 7])
def test_paged_kernel_matches_sdpa(shape, blocks):
    D, kvh, g = shape
    hd, bs, nb = 16, 4, 40
    gen = torch.Generator().manual_seed(D * 10 + blocks)
    kc = torch.randn(nb, bs, kvh, hd, generator=gen)
    vc = torch.randn(nb, bs, kvh, hd, generator=gen)
    q = torch.randn(D, kvh, g, hd, generator=gen)
    bt = torch.randint(0, nb, (D, blocks), generator=gen)
    lens = torch.randint(1, blocks * bs + 1, (D,), generator=gen)
    lens[0] = blocks * bs
    ref = _sdpa_reference(q, kc, vc, bt, lens)
    torch.testing.assert_close(paged_decode_attention(q, kc, vc, bt, lens), ref, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        out = compiled_decode_attention(q, kc, vc, bt, lens, wait=True)
    assert compiled_decode_attention.failed is None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_engine_decodes_through_the_compiled_kernel(model_dirs):
    path = model_dirs["llama-gqa-rope3"]
    engine = Engine.from_pretrained(path, num_kv_blocks=64)
    assert engine.runner.compile_decode  # the CPU default
    assert engine.warmup() > 0
    assert compiled_decode_attention.failed is None and compiled_decode_attention.compile_s is not None
    assert engine.num_free_blocks() == engine.num_total_blocks
    assert engine.cached_block_hashes(16) == []  # warm-up leaves nothing cached
    eager = Engine.from_pretrained(path, num_kv_blocks=64, compile_decode=False)
    assert not eager.runner.compile_decode


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("config", ["chunked", "preempt"])
def test_eager_path_matches_transformers(model_dirs, kind, config):
    path = model_dirs[kind]
    engine = Engine.from_pretrained(path, compile_decode=False, **CONFIGS[config])
    prompts = _prompts(engine.model.cfg.vocab_size)
    refs = _reference(path, prompts)
    results = _run(engine, prompts, waves=2)
    for p, r, ref in zip(prompts, results, refs):
        assert r.token_ids == ref, f"prompt len {len(p)}: engine {r.token_ids} != transformers {ref}"
    assert engine.num_free_blocks() == engine.num_total_blocks


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_compiled_path_matches_transformers(model_dirs, kind):
    path = model_dirs[kind]
    engine = Engine.from_pretrained(path, **CONFIGS["chunked"])
    engine.warmup()  # every decode below runs the compiled kernel
    assert compiled_decode_attention.failed is None
    prompts = _prompts(engine.model.cfg.vocab_size)
    refs = _reference(path, prompts)
    results = _run(engine, prompts, waves=2)
    for p, r, ref in zip(prompts, results, refs):
        assert r.token_ids == ref, f"prompt len {len(p)}: engine {r.token_ids} != transformers {ref}"
    assert engine.num_free_blocks() == engine.num_total_blocks
