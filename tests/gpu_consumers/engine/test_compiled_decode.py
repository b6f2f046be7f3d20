"""The paged decode attention kernels (they read K/V blocks in place through the block table: the C
kernel, and the compiled one for what the C kernel does not take) against the SDPA-over-a-gathered-copy
path they replace, and every engine path against transformers.

The other equivalence tests run the engine's default, which on a CPU is the C kernel; here the compiled
and eager paths are held to the same token-for-token equality."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_consumers.engine import Engine
from gpu_consumers.engine.attention.paged_decode import compiled_decode_attention, paged_decode_attention
from gpu_consumers.engine.kernels.native_decode_attention import NativeDecodeAttention
from gpu_consumers.engine.kernels.native_kernels import NativeKernels

from engine_test_models import MODEL_KINDS
from test_equivalence import CONFIGS, _prompts, _reference, _run

native_decode_attention = NativeKernels().attention  # the process's build, as the engines call it


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
    torch.testing.assert_close(native_decode_attention(q, kc, vc, bt, lens), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_reads_a_cache_of_its_dtype(dtype):
    """Block boundaries, a one-token context, a context of exactly whole blocks, SmolLM2's head shape."""
    kvh, g, hd, bs, nb = 3, 3, 64, 16, 50
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(2, nb, bs, kvh, hd, generator=gen).to(dtype)
    lens = torch.tensor([1, 15, 16, 17, 48, 100])
    bt = torch.randint(0, nb, (len(lens), 8), generator=gen)
    q = torch.randn(len(lens), kvh, g, hd, generator=gen)
    ref = _sdpa_reference(q, cache[0].float(), cache[1].float(), bt, lens)
    torch.testing.assert_close(native_decode_attention(q, cache[0], cache[1], bt, lens), ref, rtol=1e-5, atol=1e-5)


# (head_dim, group, block_size): the vectorized kernel's shapes (head_dim 64 and 128, every group up to 8,
# blocks shorter than its 16 lanes) and ones it leaves to the portable loop (group 9, head_dim 32, 32-position
# blocks). Queries scaled up so that scores spread over tens of units: the running max moves between
# blocks and most weights underflow, which is where a softmax written by hand goes wrong.
@pytest.mark.parametrize("shape", [(64, 1, 16), (64, 8, 16), (128, 4, 16), (128, 7, 8), (64, 3, 4),
                                   (64, 9, 16), (32, 2, 16), (64, 3, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_over_head_shapes(shape, dtype):
    hd, g, bs = shape
    kvh, nb = 2, 64
    gen = torch.Generator().manual_seed(hd + g + bs)
    cache = torch.randn(2, nb, bs, kvh, hd, generator=gen).to(dtype)
    lens = torch.tensor([1, bs - 1 or 1, bs, bs + 1, 5 * bs + 3, 8 * bs])
    bt = torch.stack([torch.randperm(nb, generator=gen)[:8] for _ in lens])
    q = torch.randn(len(lens), kvh, g, hd, generator=gen) * 4
    ref = _sdpa_reference(q, cache[0].float(), cache[1].float(), bt, lens)
    torch.testing.assert_close(native_decode_attention(q, cache[0], cache[1], bt, lens), ref, rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_native_kernel_steps_aside(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # no kernel built before
    kernel = NativeDecodeAttention()
    q = torch.randn(1, 1, 1, 16)
    cache = torch.randn(2, 4, 4, 1, 16)
    assert kernel(q, cache[0], cache[1], torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)) is None
    assert not kernel.available() and "no-such-compiler" in kernel.failed


def test_engine_decodes_through_the_native_kernel(model_dirs, monkeypatch):
    path = model_dirs["llama-gqa-rope3"]
    engine = Engine.from_pretrained(path, num_kv_blocks=64)
    assert engine.runner.compile_decode  # the CPU default
    calls = []
    real = NativeDecodeAttention.__call__
    monkeypatch.setattr(NativeDecodeAttention, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    assert engine.warmup() > 0
    assert calls and engine.model.kernels.attention.failed is None
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
def test_compiled_path_matches_transformers(model_dirs, kind, monkeypatch):
    monkeypatch.setattr(NativeDecodeAttention, "applies", lambda *a: False)
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
