"""The projections as objects that hold their weight and apply themselves (`layer(x)`): which kind a
projection is gets decided once, when the model loads (quantization/methods.py), never per call."""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from . import onednn


class Linear(Protocol):
    """x @ weight.T + bias, however the weight is held."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def numel(self) -> int: ...


class TorchLinear:
    """A float weight multiplied by torch's F.linear (MKL's GEMM for float32 on a CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def numel(self) -> int:
        return self.weight.numel() + (self.bias.numel() if self.bias is not None else 0)


class OneDnnLinear(TorchLinear):
    """A float32 CPU weight multiplied by oneDNN (onednn.py says why), held plain until `packed()`."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return onednn.onednn_linear(x, self.weight, self.bias)

    def packed(self) -> "OneDnnLinear":
        """The same product over the weight in oneDNN's own layout (a copy; the plain weight is not kept)."""
        return OneDnnLinear(onednn.pack(self.weight), self.bias)


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None, use_onednn: bool) -> TorchLinear:
    """The float product for this weight: oneDNN's where it applies (float32 on a CPU) and is wanted,
    else torch's. Held plain: `pack_float_linear` packs it once the weights are final."""
    if use_onednn and onednn.for_weights(weight.dtype, weight.device) is onednn.onednn_linear:
        return OneDnnLinear(weight, bias)
    return TorchLinear(weight, bias)


def pack_float_linear(linear: Linear) -> Linear:
    """A oneDNN projection in oneDNN's layout; any other as it is."""
    return linear.packed() if isinstance(linear, OneDnnLinear) else linear
