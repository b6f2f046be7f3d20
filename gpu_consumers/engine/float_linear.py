"""The float32 projections on CPU through oneDNN rather than MKL.

torch's `F.linear` sends a float32 CPU product to MKL's GEMM. The same wheel carries oneDNN, whose matmul
torch exposes as `torch.ops.mkldnn._linear_pointwise` (the kernel inductor's CPU path calls). On a 2-vCPU
AMD EPYC (AVX-512; 2026-12-07, 2 threads, SmolLM2-135M's 120 projection matrices streamed from memory),
MKL read the weights at 15 GB/s at batch 1 and oneDNN at 25.5 GB/s, 1.8x faster at batch 16 and 2.0x at
64; the 49,152 x 576 LM head 2.8x / 2.4x / 3.1x at batch 1 / 16 / 64 (docs/benchmarks.md has the command).
Neither library gives a row the same bits alone and inside a larger batch, so nothing the engine relies on
changes; the results differ from MKL's in the last bits (a float32 summation order).

A product of one row (a decode step of one sequence) goes to a C loop of its own instead (csrc/float_gemv.c,
built on first use by native_library.py): there the product is a stream of the weights, and oneDNN read them
at 23-29 GB/s where this loop reads them at 30-36 (the same machine and step, `tokenmill bench decode-step`).

Every other case (another dtype or device, a torch without oneDNN) stays on `F.linear`.
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch
import torch.nn.functional as F

from .native_library import NativeLibrary

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


_P, _I = ctypes.c_void_p, ctypes.c_int64
one_row_library = NativeLibrary("float_gemv.c", {"gemv_f32": [_P, _P, _P, _P, _I, _I, ctypes.c_int]})


def one_row_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
    """x @ w.T + b for one float32 CPU row by the C loop; None where it does not apply (more rows, a
    strided weight, no compiler)."""
    if (x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1 or x.dtype != torch.float32 or w.dtype != torch.float32
            or x.device.type != "cpu" or not w.is_contiguous() or (b is not None and not b.is_contiguous())):
        return None
    functions = one_row_library.load()
    if functions is None:
        return None
    N, K = w.shape
    y = torch.empty(1, N, dtype=torch.float32)
    functions["gemv_f32"](x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), N, K,
                          torch.get_num_threads())
    return y


def cpu_float32_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The engine's float32 CPU product: one row by the C loop, more by oneDNN (else F.linear)."""
    y = one_row_linear(x, w, b)
    if y is not None:
        return y
    return onednn_linear(x, w, b) if _ONEDNN is not None else F.linear(x, w, b)


def for_weights(dtype: torch.dtype, device: torch.device) -> Linear:
    """The product the engine uses for float weights of `dtype` on `device`."""
    if dtype == torch.float32 and device.type == "cpu":
        return cpu_float32_linear
    return F.linear
