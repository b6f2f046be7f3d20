"""NativeKernels: the C kernels one engine calls, made from its config (the model holds it), so that no
code reaches them through a module global and turning one off is a setting (EngineConfig.native_layer_ops).

The built libraries underneath are shared by the process (`shared_library`): the loader maps a library
once per process and each load keeps a descriptor open for the process's life (native_library.py), so a
second engine in one process reuses the first one's build instead of opening and mapping its own."""
from __future__ import annotations

import threading

import torch

from . import native_decode_attention, native_layer_ops
from .native_decode_attention import NativeDecodeAttention
from .native_layer_ops import NativeLayerOps
from .native_library import NativeLibrary

_libraries: dict[str, NativeLibrary] = {}
_libraries_lock = threading.Lock()


def shared_library(source: str, signatures: dict[str, list], extra_flags: tuple[str, ...] = ()) -> NativeLibrary:
    """The process's NativeLibrary of csrc/`source` (made on first use; built or loaded on its first call)."""
    with _libraries_lock:
        if source not in _libraries:
            _libraries[source] = NativeLibrary(source, signatures, extra_flags=extra_flags)
        return _libraries[source]


class NativeKernels:
    def __init__(self, layer_ops: bool = True) -> None:
        """layer_ops: whether the C operations between a layer's products may run (EngineConfig.native_layer_ops)."""
        self.use_layer_ops = layer_ops
        self.attention = NativeDecodeAttention(shared_library(native_decode_attention.SOURCE,
                                                              native_decode_attention.SIGNATURES))
        self.layer_ops = NativeLayerOps(shared_library(native_layer_ops.SOURCE, native_layer_ops.SIGNATURES,
                                                       native_layer_ops.FLAGS))

    def decode_attention(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                         device_type: str) -> NativeDecodeAttention | None:
        """The C decode-attention kernel where it applies to these dtypes on this device (built if needed)."""
        return self.attention if self.attention.applies(dtype, kv_cache_dtype, device_type) else None

    def layer_ops_for(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                      device_type: str) -> NativeLayerOps | None:
        """The C layer operations where they are wanted and apply (built if needed)."""
        if self.use_layer_ops and self.layer_ops.applies(dtype, kv_cache_dtype, device_type):
            return self.layer_ops
        return None
