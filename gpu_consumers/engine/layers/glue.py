"""The operations between a decoder layer's products: the residual add with the RMSNorm after it, rope
with the KV-cache write, SwiGLU. TorchGlue runs them as torch operations; NativeGlue as one C call each
(kernels/native_layer_ops.py: float32 on a CPU), falling back to TorchGlue for rows that are not
contiguous. The model picks one when it loads (`make_glue`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..attention.metadata import AttentionMetadata
from ..attention.paged_attention import store_kv
from .norm import rms_norm
from .rotary import rope

if TYPE_CHECKING:
    from ..kernels.native_layer_ops import NativeLayerOps
    from ..model.model_config import ModelConfig


class TorchGlue:
    def __init__(self, cfg: "ModelConfig") -> None:
        self.eps = cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None,
                 w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm(h + delta) * w)."""
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, w, self.eps)

    def rope_store_kv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k rotated (cos / sin: the rows at `positions`, [T, 1, head_dim]) and v, as [T, heads,
        head_dim]; k and v written into the cache at their slots."""
        T, nh, nkv, hd = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        # q and k rotated in one pass (the same elementwise arithmetic, half the ops)
        qk = rope(qkv[:, :self.q_size + self.kv_size].view(T, nh + nkv, hd), cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, self.q_size + self.kv_size:].view(T, nkv, hd)
        store_kv(k, v, cache, meta)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        g, u = gate_up.chunk(2, -1)
        return F.silu(g) * u


class NativeGlue(TorchGlue):
    def __init__(self, cfg: "ModelConfig", ops: "NativeLayerOps", cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> None:
        super().__init__(cfg)
        self.ops = ops
        self.cos_table, self.sin_table = cos_table, sin_table

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None,
                 w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The C call adds into h in place."""
        return h, self.ops.add_rms_norm(h, delta, w, self.eps)

    def rope_store_kv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not qkv.is_contiguous():
            return super().rope_store_kv(qkv, positions, cos, sin, cache, meta)
        T, nh, nkv, hd = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        self.ops.rope_store_kv(qkv, self.cos_table, self.sin_table, positions, nh, nkv, hd, cache, meta.slot_mapping)
        q = qkv[:, :self.q_size].view(T, nh, hd)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, nkv, hd)
        v = qkv[:, self.q_size + self.kv_size:].view(T, nkv, hd)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not gate_up.is_contiguous():
            return super().silu_mul(gate_up)
        return self.ops.silu_mul(gate_up)


def make_glue(cfg: "ModelConfig", ops: "NativeLayerOps | None", cos_table: torch.Tensor,
              sin_table: torch.Tensor) -> TorchGlue:
    return TorchGlue(cfg) if ops is None else NativeGlue(cfg, ops, cos_table, sin_table)
