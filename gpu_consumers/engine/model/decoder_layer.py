"""One decoder layer: its norms and its four projections (q|k|v fused, o, gate|up fused, down), each a
projection object that applies itself (layers/linear.py), made by the model's quantization method."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ..layers.linear import Linear
    from .model_config import ModelConfig

# (name, weight) -> the weight as the model holds it (its dtype, on its device)
Tensors = Callable[[str], torch.Tensor]
# (projection name, weight, bias) -> the projection
LinearFactory = Callable[[str, torch.Tensor, "torch.Tensor | None"], "Linear"]


class DecoderLayer:
    PROJECTIONS = ("qkv", "o", "gate_up", "down")

    def __init__(self, in_norm: torch.Tensor, post_norm: torch.Tensor, qkv: "Linear", o: "Linear",
                 gate_up: "Linear", down: "Linear") -> None:
        self.in_norm, self.post_norm = in_norm, post_norm
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down

    def projection_names(self) -> tuple[str, ...]:
        return self.PROJECTIONS

    def numel(self) -> int:
        return (self.in_norm.numel() + self.post_norm.numel()
                + sum(getattr(self, name).numel() for name in self.PROJECTIONS))

    @classmethod
    def load(cls, cfg: "ModelConfig", index: int, tensors: Tensors, has: Callable[[str], bool],
             make_linear: LinearFactory) -> "DecoderLayer":
        """Layer `index` of a Hugging Face Llama checkpoint: q/k/v and gate/up concatenated into one
        projection each."""
        p = f"model.layers.{index}."
        a, m = p + "self_attn.", p + "mlp."
        qkv_w = torch.cat([tensors(a + "q_proj.weight"), tensors(a + "k_proj.weight"), tensors(a + "v_proj.weight")], 0)
        qkv_b = None
        if cfg.qkv_bias:
            qkv_b = torch.cat([tensors(a + "q_proj.bias"), tensors(a + "k_proj.bias"), tensors(a + "v_proj.bias")], 0)
        gu_w = torch.cat([tensors(m + "gate_proj.weight"), tensors(m + "up_proj.weight")], 0)
        gu_b = None
        if cfg.mlp_bias:
            gu_b = torch.cat([tensors(m + "gate_proj.bias"), tensors(m + "up_proj.bias")], 0)
        o_b = tensors(a + "o_proj.bias") if cfg.o_bias and has(a + "o_proj.bias") else None
        down_b = tensors(m + "down_proj.bias") if cfg.mlp_bias and has(m + "down_proj.bias") else None
        return cls(
            in_norm=tensors(p + "input_layernorm.weight"), post_norm=tensors(p + "post_attention_layernorm.weight"),
            qkv=make_linear("qkv", qkv_w, qkv_b), o=make_linear("o", tensors(a + "o_proj.weight"), o_b),
            gate_up=make_linear("gate_up", gu_w, gu_b), down=make_linear("down", tensors(m + "down_proj.weight"), down_b),
        )
