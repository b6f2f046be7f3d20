"""Reads a validated PEFT adapter into the layout the adapter slots hold (runs on a background thread)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .lora_validation import AdapterSpec, LoraLoadError


@dataclass
class LoadedAdapter:
    """An adapter ready to be copied into a slot: per (layer, module), A as [r, in] and B as [r, out]
    with PEFT's scaling folded in (delta = x @ A.T @ B)."""
    adapter_id: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(m for _, m in self.weights)


def load_adapter(adapter_id: str, spec: AdapterSpec, dtype: torch.dtype, device) -> LoadedAdapter:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = f"{spec.path}/adapter_model.safetensors"
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise LoraLoadError(f"{file}: cannot be read ({exc})") from None
    weights = {}
    for key, (a_name, b_name) in spec.tensors.items():
        if a_name not in tensors or b_name not in tensors:
            raise LoraLoadError(f"{file}: changed while it was read ({a_name} or {b_name} is gone)")
        a = tensors[a_name].to(device=device, dtype=torch.float32)
        b = tensors[b_name].to(device=device, dtype=torch.float32)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraLoadError(f"{file}: layer {key[0]} {key[1]} holds NaN or infinite weights")
        weights[key] = (a.to(dtype).contiguous(), (b * spec.scaling).t().to(dtype).contiguous())
    return LoadedAdapter(adapter_id, spec.rank, weights)
