"""The C decode-attention kernel over the paged KV cache (csrc/paged_decode_attention.c), for CPUs.

Built on first use (native_library.py); an engine's kernels are held by its NativeKernels (native_kernels.py). Where no compiler works, `available()` is False (the reason logged
once) and the caller keeps its other paths."""
from __future__ import annotations

import ctypes

import torch

from .native_library import ArgumentChecks, NativeLibrary

# No float16 kernel: float16 caches stay on the compiled path, since gcc did not vectorize an F16C-load
# version of this loop here (measured 0.3x the compiled kernel at B = 16, where float32 and bfloat16 are
# 1.85x and 1.55x).
_ENTRY = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}
_ARGTYPES = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6
             + [ctypes.c_float, ctypes.c_int])


SOURCE = "paged_decode_attention.c"
SIGNATURES = {name: _ARGTYPES for name in _ENTRY.values()}


class NativeDecodeAttention:
    def __init__(self, library: NativeLibrary | None = None) -> None:
        """library: the build of csrc/paged_decode_attention.c to call (a fresh one when None)."""
        self.library = library if library is not None else NativeLibrary(SOURCE, SIGNATURES)

    @property
    def failed(self) -> str | None:
        return self.library.failed

    def available(self) -> bool:
        return self.library.load() is not None

    def applies(self, q_dtype: torch.dtype, kv_dtype: torch.dtype, device_type: str) -> bool:
        """Whether decode attention with these dtypes on this device runs this kernel (builds it if needed)."""
        return device_type == "cpu" and q_dtype == torch.float32 and kv_dtype in _ENTRY and self.available()

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
        """Same contract as attention/paged_decode.paged_decode_attention; None where this kernel does not apply (not on
        a CPU, not float32 queries, a cache dtype it lacks, a non-contiguous cache, no compiler). q's rows
        may lie apart (a view of the leading heads of wider rows, as the q|k|v projection leaves them);
        within a row its heads must be contiguous."""
        if v_cache.dtype != k_cache.dtype or not self.applies(q.dtype, k_cache.dtype, q.device.type):
            return None
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        D, kvh, group, head_dim = q.shape
        if not (q.stride(3) == 1 and q.stride(2) == head_dim and q.stride(1) == group * head_dim):
            q = q.contiguous()
        block_tables = block_tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        if ArgumentChecks.enabled:
            _check(q, k_cache, block_tables, lens)
        out = torch.empty(D, kvh, group, head_dim, dtype=q.dtype, device=q.device)
        functions = self.library.load()
        assert functions is not None
        functions[_ENTRY[k_cache.dtype]](
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), D, kvh, group, head_dim, k_cache.shape[1], block_tables.shape[1],
            head_dim ** -0.5, torch.get_num_threads())
        return out


def _check(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor) -> None:
    """Every block a row reads is a block of the cache, and a row's length fits its block table."""
    need = ArgumentChecks.require
    D, kvh, _, head_dim = q.shape
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    need(k_cache.dim() == 4 and tuple(k_cache.shape[2:]) == (kvh, head_dim),
         f"cache {tuple(k_cache.shape)} does not hold {kvh} heads of {head_dim}")
    need(block_tables.dim() == 2 and block_tables.shape[0] == D and lens.shape == (D,),
         "block_tables and lens need one row per query")
    if D == 0:
        return
    need(int(lens.min()) >= 1 and int(lens.max()) <= block_tables.shape[1] * block_size,
         f"a length lies outside 1..{block_tables.shape[1] * block_size} (the block table's width)")
    used = torch.arange(block_tables.shape[1]).unsqueeze(0) < (lens.unsqueeze(1) + block_size - 1) // block_size
    read = block_tables[used]
    need(bool(((read >= 0) & (read < num_blocks)).all()), f"a row reads a block outside 0..{num_blocks - 1}")

