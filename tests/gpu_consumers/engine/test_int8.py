"""int8 projections (Int8Linear, quantize_int8): the product stays close to float, smoothing helps an
input with outlier channels, and an int8 engine loads, calibrates on its tokenizer's text and generates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_consumers.engine import Engine, SamplingParams
from gpu_consumers.engine.quantization.methods import INT8_PROJECTIONS
from gpu_consumers.engine.quantization.int8_head import Int8Head, top_candidates
from gpu_consumers.engine.layers.linear import TorchLinear
from gpu_consumers.engine.quantization.int8_linear import Int8Linear
from gpu_consumers.engine.model.llama import LlamaForCausalLM


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_int8_linear_is_close_to_the_float_product_with_its_bias():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g) * 0.05, torch.randn(96, generator=g)
    x = torch.randn(3, 5, 64, generator=g)
    y = Int8Linear(w, b)(x)
    assert y.shape == (3, 5, 96)
    assert _rel_err(y, F.linear(x, w, b)) < 0.03


def test_smoothing_keeps_the_small_channels_next_to_an_outlier_channel():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 64, generator=g) * 0.05
    x = torch.randn(16, 64, generator=g)
    x[:, 7] *= 300.0  # one outlier channel, as LLM activations have
    exact = F.linear(x, w)
    plain = _rel_err(Int8Linear(w)(x), exact)
    smoothed = _rel_err(Int8Linear(w, input_absmax=x.abs().amax(0))(x), exact)
    assert smoothed < plain / 2


def test_an_int8_engine_quantizes_its_projections_and_generates(tok_model_dir):
    eng = Engine.from_pretrained(tok_model_dir, quantization="int8", compile_decode=False, num_kv_blocks=64)
    model = eng.model
    assert model.quantization == "int8"
    assert all(isinstance(getattr(L, n), Int8Linear) for L in model.layers for n in INT8_PROJECTIONS)
    assert isinstance(model.layers[0].down, TorchLinear)  # stays float (quantization/methods.py)
    assert model.layers[0].qkv.inv_smoothing is not None  # calibrated
    assert isinstance(model.lm_head, Int8Head)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first, again = eng.generate(["hello world"], params), eng.generate(["hello world"], params)
    assert len(first[0].token_ids) == 12
    assert first[0].token_ids == again[0].token_ids


def test_the_int8_heads_best_logits_are_the_float_ones_and_pick_the_float_argmax():
    g = torch.Generator().manual_seed(3)
    # a trained head's shape of the problem: a few near-tied winners (three rows close to the input's
    # direction), the rest of the vocabulary far below them
    base = torch.randn(64, generator=g)
    w = torch.randn(4096, 64, generator=g)
    w[:3] = base + 0.01 * torch.randn(3, 64, generator=g)
    x = base + 0.3 * torch.randn(64, 64, generator=g)
    exact = x @ w.T
    plain = Int8Linear(w)(x)
    head = Int8Head(w, None, alpha=0.5)(x)
    assert plain.argmax(-1).ne(exact.argmax(-1)).any()  # int8 alone flips some of these
    assert torch.equal(head.argmax(-1), exact.argmax(-1))
    top = exact.topk(3, -1).indices  # the near-tied winners carry float32's own logits
    assert torch.allclose(head.gather(-1, top), exact.gather(-1, top), atol=1e-4)


def test_an_int8_rows_result_does_not_depend_on_what_it_is_batched_with():
    g = torch.Generator().manual_seed(5)
    lin = Int8Linear(torch.randn(96, 64, generator=g), torch.randn(96, generator=g),
                     input_absmax=torch.rand(64, generator=g) + 0.1)
    row = torch.randn(1, 64, generator=g).abs()  # only positive values: its own range is one-sided
    others = -50.0 * torch.randn(7, 64, generator=g).abs()  # far larger, of the other sign
    assert torch.equal(lin(row), lin(torch.cat([others[:3], row, others[3:]]))[3:4])


def test_an_int8_engine_gives_a_request_the_same_tokens_alone_and_in_a_batch(tok_model_dir):
    eng = Engine.from_pretrained(tok_model_dir, quantization="int8", compile_decode=False, num_kv_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = eng.generate(["the quick brown fox"], params)[0].token_ids
    batched = eng.generate(["a", "the quick brown fox", "numbers 1 2 3 4 5 6 7 8 9 10 11 12"], params)
    assert batched[1].token_ids == alone


@pytest.mark.parametrize("vocab", [4096, 1000, 300])  # a multiple of the block width, not, fewer blocks than k
def test_top_candidates_are_torch_topks(vocab):
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[0, -3:] = 100.0  # winners in the last, partial block
    got = top_candidates(logits, 4).sort(-1).values
    assert torch.equal(got, logits.topk(4, -1).indices.sort(-1).values)


def test_an_unknown_quantization_is_refused(tok_model_dir):
    with pytest.raises(ValueError, match="quantization"):
        LlamaForCausalLM.from_pretrained(tok_model_dir, quantization="int4")
