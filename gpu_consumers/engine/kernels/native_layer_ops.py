"""The operations between a decoder layer's projections as one C call each (csrc/decode_layer_ops.c), for
float32 models on CPUs: a residual add with the RMSNorm after it, rope with the KV-cache write, SwiGLU's
silu(gate) * up. At a decode step's few rows each replaces several torch operations whose dispatch costs
more than their arithmetic (docs/benchmarks.md, "The glue between the products").

Built on first use (native_library.py); `applies()` is False where it is not built or not meant to run,
and the model keeps its torch operations (layers/glue.py)."""
from __future__ import annotations

import ctypes

import torch

from .native_library import ArgumentChecks, NativeLibrary

_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SOURCE = "decode_layer_ops.c"
FLAGS = ("-ffp-contract=off",)
SIGNATURES = {
    "add_rms_norm_f32": [_P, _P, _P, _P, _I, _I, _F, _T],
    "rope_store_kv_f32": [_P, _I, _I, _P, _P, _P, _I, _I, _I, _P, _P, _P, _T],
    "silu_mul_f32": [_P, _P, _I, _I, _T],
}


class NativeLayerOps:
    def __init__(self, library: NativeLibrary | None = None) -> None:
        """library: the build of csrc/decode_layer_ops.c to call (a fresh one when None)."""
        self.library = library if library is not None else NativeLibrary(SOURCE, SIGNATURES, extra_flags=FLAGS)

    @property
    def failed(self) -> str | None:
        return self.library.failed

    def applies(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, device_type: str) -> bool:
        return (device_type == "cpu" and dtype == torch.float32 and kv_cache_dtype == torch.float32
                and self.library.load() is not None)

    def _fn(self, name: str):
        functions = self.library.load()
        assert functions is not None, "call applies() first"
        return functions[name]

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """h += delta (in place, when given); returns rms_norm(h) * w. h [T, n] contiguous, delta [T, n]."""
        if ArgumentChecks.enabled:
            need = ArgumentChecks.require
            need(h.dim() == 2 and h.is_contiguous() and h.dtype == torch.float32, "h must be [T, n] contiguous f32")
            need(delta is None or (delta.shape == h.shape and delta.dtype == h.dtype), "delta must be h's shape")
            need(w.is_contiguous() and w.numel() == h.shape[1] and w.dtype == h.dtype, "w must be [n] f32")
        out = torch.empty_like(h)
        # bound to a name: a temporary's storage would be freed before the C call reads it
        delta_c = None if delta is None else delta.contiguous()
        self._fn("add_rms_norm_f32")(h.data_ptr(), None if delta_c is None else delta_c.data_ptr(),
                                     w.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], eps,
                                     torch.get_num_threads())
        return out

    def rope_store_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      q_heads: int, kv_heads: int, head_dim: int, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Rotates qkv's q and k heads in place (cos / sin: the [max_pos, head_dim] tables, read at each row's
        position) and writes each row's k and v heads into the cache ([2, blocks, block_size, kv_heads,
        head_dim], float32) at its slot."""
        positions = positions.to(torch.int64).contiguous()
        slots = slots.to(torch.int64).contiguous()
        if ArgumentChecks.enabled:
            self._check_rope(qkv, cos, sin, positions, q_heads, kv_heads, head_dim, cache, slots)
        self._fn("rope_store_kv_f32")(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                                      positions.data_ptr(), q_heads, kv_heads, head_dim, cache[0].data_ptr(),
                                      cache[1].data_ptr(), slots.data_ptr(), torch.get_num_threads())

    @staticmethod
    def _check_rope(qkv, cos, sin, positions, q_heads, kv_heads, head_dim, cache, slots) -> None:
        need = ArgumentChecks.require
        T = qkv.shape[0]
        need(qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] >= (q_heads + 2 * kv_heads) * head_dim,
             f"qkv {tuple(qkv.shape)} is narrower than {q_heads} + 2 x {kv_heads} heads of {head_dim}")
        need(positions.shape == (T,) and slots.shape == (T,), "positions and slots need one entry per row")
        need(cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == head_dim and cos.is_contiguous()
             and sin.is_contiguous(), "cos / sin must be contiguous [max_pos, head_dim]")
        need(cache.dim() == 5 and cache.shape[0] == 2 and tuple(cache.shape[3:]) == (kv_heads, head_dim)
             and cache.is_contiguous() and cache.dtype == torch.float32,
             f"cache {tuple(cache.shape)} is not a contiguous f32 [2, blocks, block_size, {kv_heads}, {head_dim}]")
        if T:
            need(0 <= int(positions.min()) and int(positions.max()) < cos.shape[0],
                 f"a position lies outside the rope table's {cos.shape[0]} rows")
            need(0 <= int(slots.min()) and int(slots.max()) < cache.shape[1] * cache.shape[2],
                 f"a slot lies outside the cache's {cache.shape[1] * cache.shape[2]} slots")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [T, 2 * inter] (gate first), as [T, inter]."""
        if ArgumentChecks.enabled:
            ArgumentChecks.require(gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0
                                   and gate_up.dtype == torch.float32, "gate_up must be [T, 2 * inter] contiguous f32")
        T, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
        self._fn("silu_mul_f32")(gate_up.data_ptr(), out.data_ptr(), T, inter, torch.get_num_threads())
        return out

