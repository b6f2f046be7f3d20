"""Adapter slots: every resident adapter's weights stacked in fixed tensors, and one step's LoRA batch.

Per target module, A is held as [layers, max_rank, slots, in] and B (scaling folded in) as
[layers, max_rank, slots, out], zero beyond each adapter's rank. For a step whose largest active rank
is r, layer l's A[l, :r] and B[l, :r] are contiguous [r * slots, in] / [r * slots, out] matrices
(column j is rank j // slots of slot j % slots), so the delta of the whole batch, every token with
its own adapter, is two matmuls and a select:

    delta = where(own, x @ A_l.T, 0) @ B_l        own[t, j] = token t's slot is j % slots

No gather of per-token weights, no loop over sequences or slots. A token without an adapter has no
column of its own; a step where no token has one gets no LoraBatch at all (the base path, unchanged).
The tensors of a module are allocated when the first adapter targeting it is installed.

Isolation between tenants (docs/lora.md, "Isolation") rests on two facts, both kept here: the first
product's columns of other slots are *replaced* by zero, never multiplied by it (x @ A of a foreign slot
may be inf or NaN for this token, and inf * 0 is NaN); and every weight a slot holds is finite
(`install` refuses anything else), so in the second product a foreign slot's row of B meets an exact
zero and adds exactly nothing. A token's delta is then a function of its own slot's weights alone,
whatever the other slots hold; an inactive slot's columns are computed and discarded like any other
foreign slot's (skipping them would need a gather of A and B per layer, which costs about what it saves).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .loader import LoadedAdapter
from formats.adapter_files import BaseShapes, LoraLoadError


class LoraSlots:
    def __init__(self, base: BaseShapes, num_slots: int, max_rank: int, dtype: torch.dtype, device) -> None:
        if num_slots < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        self.base = base
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        # module -> (A [L, R, S, in], B [L, R, S, out])
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rank = [0] * num_slots
        self.modules: list[frozenset[str]] = [frozenset()] * num_slots

    def _module_weights(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        if module not in self.weights:
            fan_in, fan_out = self.base.in_out(module)
            shape = (self.base.num_layers, self.max_rank, self.num_slots)
            self.weights[module] = (torch.zeros(*shape, fan_in, dtype=self.dtype, device=self.device),
                                    torch.zeros(*shape, fan_out, dtype=self.dtype, device=self.device))
        return self.weights[module]

    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        r = self.rank[slot]
        for a, b in self.weights.values():
            a[:, :r, slot].zero_()
            b[:, :r, slot].zero_()
        self.rank[slot] = 0
        self.modules[slot] = frozenset()

    @torch.inference_mode()
    def install(self, slot: int, adapter: LoadedAdapter) -> None:
        """Copy an adapter into a slot (between steps; a few MB); LoraLoadError, and the slot left empty,
        for a weight that is not finite in the slot's dtype (the select in LoraBatch.add needs every
        slot finite)."""
        self.clear(slot)
        # checked here only when the loader has not (its check runs off the step loop: ~40 ms here for
        # r=16 on every projection of the 135M model)
        unchecked = adapter.weights.items() if adapter.finite_in != self.dtype else ()
        for (layer, module), (a, b) in unchecked:
            for which, w in (("A", a), ("B", b)):
                if not torch.isfinite(w.to(self.dtype)).all():
                    raise LoraLoadError(f"adapter {adapter.adapter_id!r}: layer {layer} {module} lora_{which} "
                                        f"is not finite in {str(self.dtype).removeprefix('torch.')}")
        r = adapter.rank
        for (layer, module), (a, b) in adapter.weights.items():
            wa, wb = self._module_weights(module)
            wa[layer, :r, slot].copy_(a)
            wb[layer, :r, slot].copy_(b)
        self.rank[slot] = r
        self.modules[slot] = adapter.modules

    def batch(self, token_slots: list[int]) -> "LoraBatch | None":
        """The LoRA inputs of a step whose flat tokens use these slots (-1: base model); None when no
        token has an adapter."""
        active = set(token_slots)
        active.discard(-1)
        if not active:
            return None
        r = max(self.rank[s] for s in active)
        modules = frozenset().union(*(self.modules[s] for s in active))
        ts = torch.tensor(token_slots, dtype=torch.long, device=self.device)
        foreign = ts.unsqueeze(1) != torch.arange(self.num_slots, device=self.device)
        return LoraBatch(self, foreign.repeat(1, r), r, modules)


class LoraBatch:
    """One step's LoRA: which columns [T, r * slots] are not each token's own (set to zero), the rank r
    the step's matmuls run at, and the target modules any of its adapters has."""

    __slots__ = ("slots", "foreign", "rank", "modules")

    def __init__(self, slots: LoraSlots, foreign: torch.Tensor, rank: int, modules: frozenset[str]) -> None:
        self.slots = slots
        self.foreign = foreign
        self.rank = rank
        self.modules = modules

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += the LoRA delta of module at layer for every token of x (in place; out may be a
        column slice of a fused projection's output)."""
        if module not in self.modules:
            return
        a, b = self.slots.weights[module]
        r, s = self.rank, self.slots.num_slots
        xa = F.linear(x, a[layer, :r].view(r * s, -1))
        xa.masked_fill_(self.foreign, 0.0)
        out.addmm_(xa, b[layer, :r].view(r * s, -1))


