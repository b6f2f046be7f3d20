"""Rotary position embedding: the inverse frequencies (Llama-3 and linear scaling), the cos / sin tables
and the rotation."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..model.model_config import ModelConfig


def rope_inv_freq(cfg: "ModelConfig") -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    rtype = sc.get("rope_type", sc.get("type"))
    factor = float(sc["factor"])
    if rtype == "linear":
        return inv_freq / factor
    # llama3
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_len = sc.get("original_max_position_embeddings", cfg.max_position_embeddings)
    low_wl, high_wl = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, out)


def rope_tables(cfg: "ModelConfig", dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_position_embeddings, head_dim]."""
    pos = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()
    freqs = torch.outer(pos, rope_inv_freq(cfg))
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, D]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin
