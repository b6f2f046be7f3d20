"""How the decode rows attend over the paged KV cache, chosen once when the model loads
(`select_decode_backend`): the C kernel, the compiled kernel, or a gather of each sequence's blocks for
SDPA. The two paged kernels read K/V blocks where they lie and need the decode rows' context lengths
(`reads_cache_in_place`: the model runner builds them only then)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata
from .paged_decode import compiled_decode_attention

if TYPE_CHECKING:
    from ..core.config import EngineConfig
    from ..kernels.native_decode_attention import NativeDecodeAttention
    from ..kernels.native_kernels import NativeKernels
    from ..model.model_config import ModelConfig


class SdpaDecode:
    """Each decode row's blocks gathered into a padded copy, then SDPA over it."""
    reads_cache_in_place = False

    def __init__(self, cfg: "ModelConfig") -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = cfg.num_heads // cfg.num_kv_heads

    def start(self, block_size: int) -> None:
        """Called once the engine's block size is known (the compiled backend starts building its graphs)."""

    def wait(self) -> None:
        """Returns once the backend serves at full speed (the compiled one: its graphs are built)."""

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [D, heads, head_dim] -> [D, heads, head_dim]."""
        D = q.shape[0]
        bt = meta.decode_block_tables
        assert bt is not None
        nbk, bs, L = bt.shape[1], cache.shape[2], meta.decode_max_len
        flat = bt.view(-1)
        ks = cache[0].index_select(0, flat).view(D, nbk * bs, self.num_kv_heads, self.head_dim)[:, :L].transpose(1, 2)
        vs = cache[1].index_select(0, flat).view(D, nbk * bs, self.num_kv_heads, self.head_dim)[:, :L].transpose(1, 2)
        ks, vs = ks.to(q.dtype), vs.to(q.dtype)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=meta.decode_mask,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.squeeze(2)


class CompiledDecode(SdpaDecode):
    """paged_decode.paged_decode_attention under torch.compile; SDPA's gather while its graphs are still
    building in the background, or where they failed to build."""
    reads_cache_in_place = True

    def __init__(self, cfg: "ModelConfig", dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(cfg)
        self.compile_key = (self.num_kv_heads, self.group, self.head_dim, dtype, kv_cache_dtype, device.type)

    def start(self, block_size: int) -> None:
        compiled_decode_attention.prepare(self.compile_key, block_size)

    def wait(self) -> None:
        compiled_decode_attention.wait(self.compile_key)

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        D = q.shape[0]
        q = q.contiguous()  # a slice of the rotated q|k rows; the compiled kernel's graphs take q whole
        o = compiled_decode_attention(q.view(D, self.num_kv_heads, self.group, self.head_dim), cache[0], cache[1],
                                      meta.decode_block_tables, meta.decode_lens)
        if o is not None:
            return o.view(D, self.num_heads, self.head_dim)
        return super().__call__(q, cache, meta)


class NativeDecode(SdpaDecode):
    """The C kernel (kernels/native_decode_attention.py); SDPA's gather for a cache it cannot read."""
    reads_cache_in_place = True

    def __init__(self, cfg: "ModelConfig", kernel: "NativeDecodeAttention") -> None:
        super().__init__(cfg)
        self.kernel = kernel

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        D = q.shape[0]
        assert meta.decode_block_tables is not None and meta.decode_lens is not None
        o = self.kernel(q.view(D, self.num_kv_heads, self.group, self.head_dim), cache[0], cache[1],
                        meta.decode_block_tables, meta.decode_lens)
        if o is not None:
            return o.view(D, self.num_heads, self.head_dim)
        return super().__call__(q, cache, meta)


def select_decode_backend(config: "EngineConfig", cfg: "ModelConfig", kernels: "NativeKernels") -> SdpaDecode:
    """The C kernel where it applies, else the compiled one, when config.compile_decode (after its
    default) asks for a paged kernel; else SDPA."""
    if not config.decode_compiles():
        return SdpaDecode(cfg)
    device = torch.device(config.device)
    native = kernels.decode_attention(config.dtype, config.cache_dtype, device.type)
    if native is not None:
        return NativeDecode(cfg, native)
    return CompiledDecode(cfg, config.dtype, config.cache_dtype, device)
