"""RMSNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # the same arithmetic as below in one call (bitwise equal on CPU): at batch 1 a decode step
        # beyond its matrix products is mostly the dispatch of small ops, 61 norms of ~8 ops each
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return w * (xf * torch.rsqrt(var + eps)).to(x.dtype)
