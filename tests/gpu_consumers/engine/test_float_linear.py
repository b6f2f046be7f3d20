"""The float32 projections through oneDNN: the same product as F.linear to float32 rounding, used
only where it applies."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_consumers.engine import float_linear

needs_onednn = pytest.mark.skipif(float_linear._ONEDNN is None, reason="this torch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_gives_f_linears_product(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(320, 96, generator=g)
    b = torch.randn(320, generator=g) if with_bias else None
    x = torch.randn(rows, 160, generator=g)[:, :96]  # a strided view, as a slice of a wider row
    got = float_linear.onednn_linear(x, w, b)
    assert got.shape == (rows, 320) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_float32_on_cpu_goes_to_onednn_and_the_rest_to_f_linear():
    assert float_linear.for_weights(torch.float32, torch.device("cpu")) is float_linear.cpu_float32_linear
    assert float_linear.for_weights(torch.bfloat16, torch.device("cpu")) is F.linear
    assert float_linear.for_weights(torch.float32, torch.device("cuda")) is F.linear
    # inputs the oneDNN call does not take are passed on, with F.linear's answer
    w = torch.randn(8, 4)
    x3 = torch.randn(2, 3, 4)
    assert torch.equal(float_linear.onednn_linear(x3, w, None), F.linear(x3, w))
    xb, wb = torch.randn(2, 4, dtype=torch.bfloat16), w.to(torch.bfloat16)
    assert torch.equal(float_linear.onednn_linear(xb, wb, None), F.linear(xb, wb))


@pytest.mark.parametrize("shape", [(576, 576), (3072, 576), (49152, 576), (576, 1536), (7, 48), (10, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_row_gives_f_linears_product(shape, with_bias):
    """SmolLM2's projections and LM head, and shapes off the vector loop (rows not a multiple of 4, a
    width not a multiple of 16)."""
    N, K = shape
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    x = torch.randn(1, K + 32, generator=g)[:, 16:16 + K]  # a slice of a wider row
    got = float_linear.one_row_linear(x, w, b)
    assert got is not None, float_linear.one_row_library.failed
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(float_linear.cpu_float32_linear(x, w, b), got, rtol=0, atol=0)


def test_more_rows_or_a_strided_weight_go_past_the_one_row_loop():
    w = torch.randn(64, 32)
    assert float_linear.one_row_linear(torch.randn(2, 32), w, None) is None
    assert float_linear.one_row_linear(torch.randn(1, 64), w.t(), None) is None
    assert float_linear.cpu_float32_linear(torch.randn(3, 32), w, None).shape == (3, 64)
