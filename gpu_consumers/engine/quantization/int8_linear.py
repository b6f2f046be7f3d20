"""Int8Linear: a projection's weight stored as int8 (one scale per output channel) and multiplied by
torch's dynamic-quantized GEMM (fbgemm / oneDNN on x86: each call quantizes its input to int8 with one
scale for the whole tensor, and the product runs on the CPU's int8 dot-product instructions, VNNI where
it has them).

Why this kernel: measured on this project's CPUs (docs/benchmarks.md, "int8 weights"), bf16 GEMMs
convert without AVX512-BF16, and aten's weight-only int8 kernel and `_int_mm` are slower than fp32,
while this one is 1.5-7x faster than fp32 on SmolLM2's shapes; it reads a quarter of fp32's weight
bytes, which is what bounds a decode step. It is what llama.cpp's Q8_0 does (int8 weights, activations
quantized for the dot products).

The kernel quantizes its input with one scale for the whole tensor, so each row is first divided by its
own largest magnitude (and the product multiplied back), and one anchor row (+1, -1, 0, ...) is appended
so that the tensor's range is always [-1, 1]: the kernel's scale and zero point are then the same for
every call, which makes them, in effect, one scale per token. A token with huge activations (a chat
template's first tokens have them) costs nothing to the others in its batch, and a row's result does
not depend on what it is batched with: a request gives the same tokens alone, in a full batch, and
when another worker resumes it. Measured on SmolLM2: 96.5% greedy agreement with float32 against
95.8% with one scale per batch.

One scale for a whole row still loses the small channels next to a few huge ones (LLM activations have
such outlier channels). `input_absmax` (each input channel's largest magnitude seen in calibration) turns on
SmoothQuant's migration: input channel j is divided by s_j = absmax_j^alpha / max|W[:, j]|^(1-alpha) and
the weight's column j multiplied by it, so the product is unchanged and both sides quantize well.
"""
from __future__ import annotations

import functools
import warnings

import torch

# SmoothQuant's migration strength; 0.7 measured against 0.5 and 0.85 on SmolLM2 (docs/benchmarks.md)
SMOOTHING_ALPHA = 0.7


@functools.cache
def reduce_range() -> bool:
    """Whether activations are quantized to 7 bits rather than 8: on x86 CPUs without VNNI the int8 product
    (vpmaddubsw) adds pairs of u8 x s8 products into int16, which saturates at full range (255 x 127 x 2 >
    32767). Measured on an AVX2-only AMD EPYC: relative error of a 64 -> 96 product 0.035 at 8 bits, 0.006
    at 7; of 576 -> 1536, 0.020 and 0.017. With VNNI (or AMX) the sums are 32-bit and all 8 bits are kept."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return True
    return not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 input_absmax: torch.Tensor | None = None, alpha: float = SMOOTHING_ALPHA) -> None:
        if weight.device.type != "cpu":
            raise ValueError("int8 weights run on a CPU only (torch's quantized GEMMs are CPU kernels)")
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.inv_smoothing: torch.Tensor | None = None
        if input_absmax is not None:
            s = (input_absmax.float().clamp(min=1e-5).pow(alpha)
                 / w.abs().amax(dim=0).clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)
            w = w * s
            self.inv_smoothing = 1.0 / s
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).double()
        zero = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # torch (2.15 here) marks its quantized tensors deprecated (pytorch issue 184982) though
            # linear_prepack/linear_dynamic take nothing else; one warning per projection at every
            # worker start said nothing a worker's operator can act on. The notice is in docs/benchmarks.md.
            warnings.filterwarnings("ignore", message=".*quantize_per_channel.*deprecated", category=UserWarning)
            q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        self.bias = None if bias is None else bias.detach().float()
        self.nbytes = q.numel() + scale.numel() * 4 + (bias.numel() * 4 if bias is not None else 0)
        # without its bias: the bias is added after each row is scaled back
        self._packed = torch.ops.quantized.linear_prepack(q, None)
        self._anchor = torch.zeros(1, self.in_features)
        self._anchor[0, 0], self._anchor[0, -1] = 1.0, -1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        x2 = x2 * self.inv_smoothing if self.inv_smoothing is not None else x2.clone()
        # abs().amax() rather than vector_norm(inf): 6x faster on these rows (measured)
        row_scale = x2.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12)
        rows = torch.cat([x2.div_(row_scale), self._anchor])
        y = torch.ops.quantized.linear_dynamic(rows, self._packed, reduce_range())[:-1].mul_(row_scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*lead, self.out_features).to(x.dtype)

    def numel(self) -> int:
        return self.out_features * self.in_features
