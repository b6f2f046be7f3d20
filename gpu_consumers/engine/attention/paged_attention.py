"""Attention of a packed batch over the paged KV cache: the decode rows (first) by the decode backend,
each prefill chunk by SDPA over its own tokens or, after a cached prefix, over its blocks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode_backends import SdpaDecode
from .metadata import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Writes this step's K/V into the paged cache at their slots."""
    nkv, hd = k.shape[1], k.shape[2]
    nb, bs = cache.shape[1], cache.shape[2]
    cache[0].view(nb * bs, nkv, hd).index_copy_(0, meta.slot_mapping, k.to(cache.dtype))
    cache[1].view(nb * bs, nkv, hd).index_copy_(0, meta.slot_mapping, v.to(cache.dtype))


class PagedAttention:
    def __init__(self, decode: SdpaDecode) -> None:
        self.decode = decode

    def store_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        store_kv(k, v, cache, meta)
        return self(q, k, v, cache, meta)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Attention over a cache that holds this step's K/V already.
        q: [T, nh, hd]; k, v: [T, nkv, hd]; returns [T, nh, hd]."""
        T, nh, hd = q.shape
        nkv = k.shape[1]
        bs = cache.shape[2]
        D = meta.num_decodes
        if D == T:
            return self.decode(q, cache, meta)  # decodes only: no rows to assemble
        attn = torch.empty(T, nh, hd, dtype=q.dtype, device=q.device)
        if D:
            attn[:D] = self.decode(q[:D], cache, meta)
        for start, end, ctx_len, blocks, mask in meta.prefills:
            qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, nh, n, hd]
            if blocks is None:
                ks = k[start:end].transpose(0, 1).unsqueeze(0)
                vs = v[start:end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=nh != nkv)
            else:
                nbk = blocks.shape[0]
                ks = cache[0].index_select(0, blocks).view(1, nbk * bs, nkv, hd)[:, :ctx_len].transpose(1, 2)
                vs = cache[1].index_select(0, blocks).view(1, nbk * bs, nkv, hd)[:, :ctx_len].transpose(1, 2)
                ks, vs = ks.to(q.dtype), vs.to(q.dtype)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=nh != nkv)
            attn[start:end] = o[0].transpose(0, 1)
        return attn
