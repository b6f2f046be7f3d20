"""The C decode-attention kernel over the paged KV cache (csrc/paged_decode_attention.c), for CPUs.

Built on first use with the machine's C compiler (`$CC`, else `cc`; -O3 -march=native -fopenmp), about a
second, into a per-user cache directory named by a hash of the source, the flags, the compiler and the
CPU, so each machine builds it once; loaded with ctypes. Where no compiler works, `available()` is
False (the reason logged once) and the caller keeps its other paths."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]
# No float16 kernel: float16 caches stay on the compiled path, since gcc did not vectorize an F16C-load
# version of this loop here (measured 0.3x the compiled kernel at B = 16, where float32 and bfloat16 are
# 1.85x and 1.55x).
_ENTRY = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


class NativeDecodeAttention:
    def __init__(self) -> None:
        self.failed: str | None = None
        self._functions: dict[torch.dtype, ctypes._CFuncPtr] | None = None
        self._lock = threading.Lock()

    def available(self) -> bool:
        if self._functions is None and self.failed is None:
            with self._lock:
                if self._functions is None and self.failed is None:
                    self._load()
        return self._functions is not None

    def _load(self) -> None:
        cc = os.environ.get("CC", "cc")
        try:
            version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
            key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_flags()]).encode()).hexdigest()
            cache = Path(tempfile.gettempdir()) / f"tokenmill-kernels-{os.getuid()}"
            lib = cache / f"paged_decode_attention-{key[:16]}.so"
            if not lib.exists():
                cache.mkdir(parents=True, exist_ok=True)
                partial = cache / f".{lib.name}.{os.getpid()}.{threading.get_ident()}"
                subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(partial), "-lm"], capture_output=True,
                               text=True, check=True)
                os.replace(partial, lib)  # atomic: a concurrent builder never loads a half-written file
            handle = ctypes.CDLL(str(lib))
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", None) or str(exc)
            self.failed = f"{type(exc).__name__}: {detail.strip().splitlines()[0][:200] if detail.strip() else ''}"
            log.warning("native paged decode attention unavailable: %s", self.failed)
            return
        functions = {}
        for dtype, name in _ENTRY.items():
            fn = getattr(handle, name)
            fn.argtypes, fn.restype = _ARGTYPES, None
            functions[dtype] = fn
        self._functions = functions

    def applies(self, q_dtype: torch.dtype, kv_dtype: torch.dtype, device_type: str) -> bool:
        """Whether decode attention with these dtypes on this device runs this kernel (builds it if needed)."""
        return device_type == "cpu" and q_dtype == torch.float32 and kv_dtype in _ENTRY and self.available()

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
        """Same contract as model.paged_decode_attention; None where this kernel does not apply (not on
        a CPU, not float32 queries, a cache dtype it lacks, a non-contiguous input, no compiler)."""
        if v_cache.dtype != k_cache.dtype or not self.applies(q.dtype, k_cache.dtype, q.device.type):
            return None
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        q = q.contiguous()
        block_tables = block_tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        D, kvh, group, head_dim = q.shape
        out = torch.empty_like(q)
        assert self._functions is not None
        self._functions[k_cache.dtype](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), D, kvh, group, head_dim, k_cache.shape[1], block_tables.shape[1],
            head_dim ** -0.5, torch.get_num_threads())
        return out


native_decode_attention = NativeDecodeAttention()
