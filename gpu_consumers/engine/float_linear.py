"""The float32 projections on CPU through oneDNN rather than MKL.

torch's `F.linear` sends a float32 CPU product to MKL's GEMM. The same wheel carries oneDNN, whose matmul
torch exposes as `torch.ops.mkldnn._linear_pointwise` (the kernel inductor's CPU path calls). On a 2-vCPU
AMD EPYC (AVX-512; 2026-12-07, 2 threads, SmolLM2-135M's 120 projection matrices streamed from memory),
MKL read the weights at 15 GB/s at batch 1 and oneDNN at 25.5 GB/s, 1.8x faster at batch 16 and 2.0x at
64; the 49,152 x 576 LM head 2.8x / 2.4x / 3.1x at batch 1 / 16 / 64 (docs/benchmarks.md has the command).
Neither library gives a row the same bits alone and inside a larger batch, so nothing the engine relies on
changes; the results differ from MKL's in the last bits (a float32 summation order).

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
    """x @ w.T + b by oneDNN, for 2-D float32 CPU inputs (anything else goes to F.linear)."""
    if x.dim() != 2 or x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, w, b)
    return _ONEDNN(x, w, b, "none", [], "")


def for_weights(dtype: torch.dtype, device: torch.device) -> Linear:
    """The product the engine uses for float weights of `dtype` on `device`."""
    if _ONEDNN is not None and dtype == torch.float32 and device.type == "cpu":
        return onednn_linear
    return F.linear
