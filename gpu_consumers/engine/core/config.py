"""EngineConfig: every setting of an engine in one place (its constructor and from_pretrained
both take one, or its fields as keywords)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# optimize= presets: (max_num_seqs, max_num_batched_tokens)
PRESETS = {
    # small batches and small prefill chunks: short steps -> low TTFT / ITL
    "latency": (16, 256),
    # the batch size where a 2-core CPU reaches its throughput plateau, and big prefill chunks
    "throughput": (64, 2048),
}
# The default serves an interactive API: the throughput plateau's batch size, but steps of at most
# 256 tokens. A 2048-token prefill chunk holds every decoding stream for about a second on a CPU
# (ITL p99 ~1.1 s against ~0.3 s) and every arriving request waits for such a step to end; the
# price is 15-25% of output throughput when prompts are long (docs/benchmarks.md, "The default step").
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256

QUANTIZATIONS = ("int8",)
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    # Where the model runs and in which element type its weights and activations are.
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    # None (weights in `dtype`) or "int8" (QUANTIZATIONS): q/k/v, o, gate/up and the LM head as int8
    # through torch's dynamic-quantized GEMM, on a CPU (quantization/int8_method.py).
    quantization: str | None = None
    # The KV cache's element type when not `dtype` (KV_CACHE_DTYPES: 16 bits halve the cache's memory;
    # attention still computes in `dtype`).
    kv_cache_dtype: torch.dtype | None = None
    # float32 products on a CPU through oneDNN with weights packed in its layout (layers/onednn.py);
    # False: torch's F.linear (MKL), the products before oneDNN.
    use_onednn: bool = True
    # The operations between a layer's products as C calls where they apply (kernels/native_layer_ops.py);
    # False: torch's operations.
    native_layer_ops: bool = True
    # KV cache size: bytes to spend on it, or a block count (which wins when given).
    kv_cache_memory: int | None = 512 * 2**20
    num_kv_blocks: int | None = None
    block_size: int = 16
    # Sequences in one step, and tokens in one step (prefill chunks included); None: the preset's
    # value (optimize), else the defaults above.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    optimize: str | None = None
    enable_prefix_caching: bool = True
    # Longest prompt + completion; None: the model's position limit.
    max_model_len: int | None = None
    # Decode attention through the torch.compile'd paged kernel that reads K/V blocks in place
    # (attention/decode_backends.py: the C kernel where it applies, else attention/paged_decode.py's compiled
    # one); None: on a CPU (measured there, docs/benchmarks.md), off elsewhere.
    # Off, or when it cannot compile, decode attention gathers each sequence's blocks for SDPA.
    compile_decode: bool | None = None
    # LoRA adapters (docs/lora.md): how many are resident at once (slots in the stacked adapter
    # weights, LRU-evicted), and the largest rank an adapter may have (sizes each slot).
    max_loras: int = 4
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES.values():
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)} or None, "
                             f"not {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, not {self.quantization!r}")

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type."""
        return self.kv_cache_dtype if self.kv_cache_dtype is not None else self.dtype

    def decode_compiles(self) -> bool:
        """compile_decode after its default (on where the model runs on a CPU)."""
        if self.compile_decode is None:
            return torch.device(self.device).type == "cpu"
        return self.compile_decode

    def model_settings(self) -> tuple:
        """The settings the model is loaded with (the rest are the engine's own)."""
        return (self.device, self.dtype, self.quantization, self.kv_cache_dtype, self.use_onednn,
                self.native_layer_ops, self.decode_compiles())

    def batch_limits(self) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) after presets and defaults."""
        seqs, tokens = self.max_num_seqs, self.max_num_batched_tokens
        if self.optimize is not None:
            if self.optimize not in PRESETS:
                raise ValueError(f"optimize must be one of {sorted(PRESETS)} or None")
            p_seqs, p_tokens = PRESETS[self.optimize]
            seqs, tokens = seqs or p_seqs, tokens or p_tokens
        seqs, tokens = seqs or DEFAULT_MAX_NUM_SEQS, tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if tokens < seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        return seqs, tokens
