"""The float32 projections on CPU through oneDNN rather than MKL.

torch's `F.linear` sends a float32 CPU product to MKL's GEMM. The same wheel carries oneDNN, whose matmul
torch exposes as `torch.ops.mkldnn._linear_pointwise` (the kernel inductor's CPU path calls). On a 2-vCPU
AMD EPYC (AVX-512; 2026-12-07, 2 threads, SmolLM2-135M's 120 projection matrices streamed from memory),
MKL read the weights at 15 GB/s at batch 1 and oneDNN at 25.5 GB/s, 1.8x faster at batch 16 and 2.0x at
64; the 49,152 x 576 LM head 2.8x / 2.4x / 3.1x at batch 1 / 16 / 64 (docs/benchmarks.md has the command).
Neither library gives a row the same bits alone and inside a larger batch, so nothing the engine relies on
changes; the results differ from MKL's in the last bits (a float32 summation order).

The weights are handed to oneDNN once in its own blocked layout (`pack`, torch's
`torch.ops.mkldnn._reorder_linear_weight`, what inductor does to frozen weights), not as plain row-major
matrices that it reorders for every product: measured on the same machine and step (`tokenmill bench
decode-step`'s projections), 1.7x at 16 rows, 1.4x at 64, 1.3x at one; prefill chunks of hundreds of rows
~1.05x. The packed tensor replaces the plain one (same shape, dtype and values; `to_dense()` gives the
plain one back), so the memory stays that of one copy, except for a tied LM head, whose packed copy sits
beside the embedding it is read from.

Every other case (another dtype or device, a torch without oneDNN) stays on `F.linear`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _onednn_op():
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_ONEDNN = _onednn_op()


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + b by oneDNN, for 2-D float32 CPU inputs (anything else goes to F.linear); w plain or packed."""
    if x.dim() != 2 or x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, plain(w), b)
    return _ONEDNN(x, w, b, "none", [], "")


# oneDNN picks its blocked layout for an expected number of rows; 16 and 64 measured alike, 1 worse at 4-16
PACKING_ROWS = 64


def pack(w: torch.Tensor) -> torch.Tensor:
    """w in oneDNN's own layout for the products of onednn_linear (w itself where oneDNN is absent)."""
    if _ONEDNN is None or w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACKING_ROWS)


def plain(w: torch.Tensor) -> torch.Tensor:
    """A weight as a plain row-major tensor (a packed one converted back)."""
    return w.to_dense() if w.is_mkldnn else w


def for_weights(dtype: torch.dtype, device: torch.device) -> Linear:
    """The product the engine uses for float weights of `dtype` on `device`."""
    if _ONEDNN is not None and dtype == torch.float32 and device.type == "cpu":
        return onednn_linear
    return F.linear
