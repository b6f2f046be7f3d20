"""Reads a validated PEFT adapter into the layout the adapter slots hold (runs on a background thread)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from formats.adapter_files import MAX_LORA_WEIGHT, AdapterSpec, LoraLoadError


@dataclass
class LoadedAdapter:
    """An adapter ready to be copied into a slot: per (layer, module), A as [r, in] and B as [r, out]
    with PEFT's scaling folded in (delta = x @ A.T @ B)."""
    adapter_id: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # the dtype in which every weight is known finite (load_adapter's bound checks, on its own thread);
    # None: LoraSlots.install checks them itself, on the step loop
    finite_in: torch.dtype | None = None

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
        b = tensors[b_name].to(device=device, dtype=torch.float32) * spec.scaling
        _check_bound(file, a_name, a, "")
        _check_bound(file, b_name, b, f" scaled by {spec.scaling:g}")
        weights[key] = (a.to(dtype).contiguous(), b.t().to(dtype).contiguous())
    # |w| <= MAX_LORA_WEIGHT (1e4) is finite in every float dtype (float16's largest is 65504)
    return LoadedAdapter(adapter_id, spec.rank, weights, finite_in=dtype)


def _check_bound(file: str, name: str, w: torch.Tensor, scaled: str) -> None:
    """The same bound registration applies, checked again on what the slots will hold."""
    if not torch.isfinite(w).all():
        raise LoraLoadError(f"{file}: tensor {name!r}{scaled} holds NaN or infinite values")
    peak = float(w.abs().max()) if w.numel() else 0.0
    if peak > MAX_LORA_WEIGHT:
        raise LoraLoadError(f"{file}: tensor {name!r}{scaled} reaches {peak:.3g}, over the bound of "
                            f"{MAX_LORA_WEIGHT:g} on an adapter weight")
