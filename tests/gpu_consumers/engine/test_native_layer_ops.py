"""The C operations between a layer's projections (native_layer_ops.py) against the torch operations
they replace, and the engine with them against the engine without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_consumers.engine import Engine, SamplingParams
from gpu_consumers.engine.kernels import native_kernels
from gpu_consumers.engine.kernels.native_kernels import NativeKernels
from gpu_consumers.engine.kernels.native_layer_ops import NativeLayerOps
from gpu_consumers.engine.kernels.native_library import NativeLibrary
from gpu_consumers.engine.layers.glue import TorchGlue
from gpu_consumers.engine.layers.rotary import rope

from test_equivalence import _prompts

native_layer_ops = NativeKernels().layer_ops  # the process's build, as the engines call it


@pytest.fixture(autouse=True)
def _built():
    assert native_layer_ops.applies(torch.float32, torch.float32, "cpu"), native_layer_ops.failed


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 16), (2, 1, 128)])  # (q heads, kv heads, head_dim)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300: the parallel loop
def test_rope_and_the_cache_write_are_bitwise_torchs(heads, rows):
    nh, nkv, hd = heads
    gen = torch.Generator().manual_seed(rows + hd)
    qkv = torch.randn(rows, (nh + 2 * nkv) * hd, generator=gen) * 3
    positions = torch.randint(0, 400, (rows,), generator=gen)
    angles = torch.outer(torch.arange(512).float(), torch.rand(hd // 2, generator=gen))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    blocks, bs = rows // 16 + 4, 16
    slots = torch.randperm(blocks * bs, generator=gen)[:rows]
    cache = torch.randn(2, blocks, bs, nkv, hd, generator=gen)
    expected_cache = cache.clone()

    qk = rope(qkv[:, :(nh + nkv) * hd].view(rows, nh + nkv, hd),
                               cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    v = qkv[:, (nh + nkv) * hd:].view(rows, nkv, hd)
    expected_cache[0].view(-1, nkv, hd).index_copy_(0, slots, qk[:, nh:])
    expected_cache[1].view(-1, nkv, hd).index_copy_(0, slots, v)
    expected_qkv = torch.cat([qk.reshape(rows, -1), v.reshape(rows, -1)], 1)

    native_layer_ops.rope_store_kv(qkv, cos, sin, positions, nh, nkv, hd, cache, slots)
    assert torch.equal(qkv, expected_qkv)  # q and k rotated in place, v as it was
    assert torch.equal(cache, expected_cache)  # the rows at the slots written, every other row untouched


@pytest.mark.parametrize("rows", [1, 16, 200])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_and_norm_match_torch(rows, with_delta):
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 576, generator=gen) * 5
    delta = torch.randn(rows, 576, generator=gen) if with_delta else None
    w = 1 + 0.1 * torch.randn(576, generator=gen)
    expected_h = h + delta if with_delta else h.clone()
    expected = F.rms_norm(expected_h, (576,), w, 1e-5)
    out = native_layer_ops.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(h, expected_h)  # the residual added in place, exactly
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [1, 16, 64])  # 64 x 1536: the parallel loop
def test_silu_mul_matches_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 4
    gate_up[0, :6] = torch.tensor([-200.0, -90.0, -20.0, 0.0, 90.0, 200.0])  # beyond the exponential's clamp
    g, u = gate_up.chunk(2, -1)
    torch.testing.assert_close(native_layer_ops.silu_mul(gate_up), F.silu(g) * u, rtol=2e-6, atol=1e-6)


def test_engine_with_the_layer_ops_decodes_as_without(model_dirs, monkeypatch):
    """Chunked prefills mixed with decodes, a cached prefix, LoRA-free: the same greedy tokens with the C
    operations and with torch's, and the C ones really ran."""
    path = model_dirs["llama-gqa-rope3"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = {}
    for enabled in (True, False):
        engine = Engine.from_pretrained(path, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=32,
                                        native_layer_ops=enabled)
        calls = []
        real = NativeLayerOps.rope_store_kv
        monkeypatch.setattr(NativeLayerOps, "rope_store_kv", lambda self, *a: calls.append(1) or real(self, *a))
        prompts = _prompts(engine.model.cfg.vocab_size)
        runs[enabled] = [r.token_ids for r in engine.generate(prompts, params)]
        assert bool(calls) == enabled
        assert engine.num_free_blocks() == engine.num_total_blocks
    assert runs[True] == runs[False]


def test_without_a_compiler_the_model_keeps_torchs_operations(model_dirs, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # no library built before
    shared = native_kernels.shared_library

    def fresh_layer_ops(source, signatures, extra_flags=()):
        if source == "decode_layer_ops.c":
            return NativeLibrary(source, signatures, extra_flags=extra_flags)
        return shared(source, signatures, extra_flags)
    monkeypatch.setattr(native_kernels, "shared_library", fresh_layer_ops)
    engine = Engine.from_pretrained(model_dirs["llama-tied"], num_kv_blocks=64)
    missing = engine.model.kernels.layer_ops
    assert type(engine.model.glue) is TorchGlue
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert not missing.applies(torch.float32, torch.float32, "cpu") and "no-such-compiler" in missing.failed
