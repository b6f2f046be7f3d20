"""The float32 projections through oneDNN: the same product as F.linear to float32 rounding, used
only where it applies."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_consumers.engine.layers import onednn

needs_onednn = pytest.mark.skipif(onednn._ONEDNN is None, reason="this torch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_gives_f_linears_product(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(320, 96, generator=g)
    b = torch.randn(320, generator=g) if with_bias else None
    x = torch.randn(rows, 160, generator=g)[:, :96]  # a strided view, as a slice of a wider row
    got = onednn.onednn_linear(x, w, b)
    assert got.shape == (rows, 320) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_float32_on_cpu_goes_to_onednn_and_the_rest_to_f_linear():
    assert onednn.for_weights(torch.float32, torch.device("cpu")) is onednn.onednn_linear
    assert onednn.for_weights(torch.bfloat16, torch.device("cpu")) is F.linear
    assert onednn.for_weights(torch.float32, torch.device("cuda")) is F.linear
    # inputs the oneDNN call does not take are passed on, with F.linear's answer
    w = torch.randn(8, 4)
    x3 = torch.randn(2, 3, 4)
    assert torch.equal(onednn.onednn_linear(x3, w, None), F.linear(x3, w))
    xb, wb = torch.randn(2, 4, dtype=torch.bfloat16), w.to(torch.bfloat16)
    assert torch.equal(onednn.onednn_linear(xb, wb, None), F.linear(xb, wb))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 4, 16, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_weight_gives_the_plain_ones_product(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if with_bias else None
    packed = onednn.pack(w)
    assert packed.is_mkldnn and packed.shape == w.shape and torch.equal(onednn.plain(packed), w)
    x = torch.randn(rows, 96, generator=g)
    torch.testing.assert_close(onednn.onednn_linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, rows, 96, generator=g)  # not 2-D: F.linear on the plain weight
    torch.testing.assert_close(onednn.onednn_linear(x3, packed, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_the_engines_float32_model_holds_packed_weights(model_dirs):
    from gpu_consumers.engine.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dirs["llama-tied"])
    assert all(getattr(L, k).weight.is_mkldnn for L in model.layers for k in L.projection_names())
    assert model.lm_head.weight.is_mkldnn and not model.embed.is_mkldnn  # the lookup reads the plain embedding
    bf16 = LlamaForCausalLM.from_pretrained(model_dirs["llama-tied"], dtype=torch.bfloat16)
    assert not bf16.layers[0].qkv.weight.is_mkldnn and bf16.lm_head.weight is bf16.embed
