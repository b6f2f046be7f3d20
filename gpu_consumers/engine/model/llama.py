"""The Llama-family model (Llama / Llama-3 rope scaling, Mistral, Qwen2) as the engine runs it.

Tokens of many sequences (prefill chunks and decodes) are packed into ONE forward with per-token
positions. K/V of every token is written into a preallocated paged KV pool (one tensor per layer, shape
[2, num_blocks, block_size, kv_heads, head_dim]) at its slot, and attention reads the sequence's context
back through its block table.

What runs is chosen once, when the model loads, from its EngineConfig: each projection's kind by the
quantization method (quantization/methods.py), the operations between the products (layers/glue.py: C
calls or torch's) and the decode attention backend (attention/decode_backends.py)."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..attention.decode_backends import select_decode_backend
from ..attention.metadata import AttentionMetadata, PrefillChunk
from ..attention.paged_attention import PagedAttention
from ..core.config import EngineConfig
from ..kernels.native_kernels import NativeKernels
from ..layers.glue import make_glue
from ..layers.linear import Linear
from ..layers.rotary import rope_tables
from ..quantization.methods import UnquantizedMethod, quantization_method
from .decoder_layer import DecoderLayer
from .model_config import ModelConfig
from .weights import load_state_dict

if TYPE_CHECKING:
    from ..lora.slots import LoraBatch


class LlamaForCausalLM:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], config: EngineConfig,
                 method: UnquantizedMethod, kernels: NativeKernels) -> None:
        """The model with `method`'s projections as created from the weights; `method.process_after_loading`
        finishes them (from_pretrained does both)."""
        self.cfg = cfg
        self.config = config
        self.dtype = config.dtype
        self.kv_cache_dtype = config.cache_dtype
        self.device = torch.device(config.device)
        self.quantization = config.quantization

        def tensors(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=self.dtype).contiguous()

        self.embed = tensors("model.embed_tokens.weight")
        self.layers = [DecoderLayer.load(cfg, i, tensors, weights.__contains__, method.create_linear)
                       for i in range(cfg.num_layers)]
        self.norm = tensors("model.norm.weight")
        self.tied_lm_head = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        head = self.embed if self.tied_lm_head else tensors("lm_head.weight")
        self.lm_head: Linear = method.create_linear("lm_head", head, None)
        self.cos, self.sin = rope_tables(cfg, self.dtype, self.device)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.kernels = kernels
        self.glue = make_glue(cfg, kernels.layer_ops_for(self.dtype, self.kv_cache_dtype, self.device.type),
                              self.cos, self.sin)
        self.attention = PagedAttention(select_decode_backend(config, cfg, kernels))

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig | None = None, calibration_ids: list[int] | None = None,
                        **options) -> "LlamaForCausalLM":
        """The checkpoint at `path` as `config` (with `options`, EngineConfig fields, overriding it) says:
        its device, dtype, quantization (int8: calibrated on `calibration_ids`, random tokens when None),
        KV cache dtype, products and kernels."""
        config = replace(config or EngineConfig(), **options)
        method = quantization_method(config.quantization, config.use_onednn)
        model = cls(ModelConfig.from_pretrained(path), load_state_dict(path), config, method,
                    NativeKernels(layer_ops=config.native_layer_ops))
        method.process_after_loading(model, calibration_ids)
        return model

    def num_params(self) -> int:
        n = self.embed.numel() + self.norm.numel()
        if not self.tied_lm_head:
            n += self.lm_head.numel()
        return n + sum(layer.numel() for layer in self.layers)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        c = self.cfg
        return [
            torch.zeros(2, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype=self.kv_cache_dtype,
                        device=self.device)
            for _ in range(c.num_layers)
        ]

    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.cfg
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * torch.finfo(self.kv_cache_dtype).bits // 8

    # ----------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], lora: "LoraBatch | None" = None) -> torch.Tensor:
        """Returns final-norm hidden states [T, hidden]. ``lora``: the step's adapters (lora/slots.py);
        each targeted projection adds its LoRA delta for the whole batch at once.

        Each residual add is carried to the norm after it (`add_norm`), so that where the C layer ops apply
        (float32 on CPU, layers/glue.py) the add and the norm are one call, as are rope with the KV-cache
        write and SwiGLU; elsewhere they are the same torch operations as always."""
        glue, attention = self.glue, self.attention
        T = input_ids.shape[0]
        qs, ks = self.q_size, self.q_size + self.kv_size
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        h = F.embedding(input_ids, self.embed)
        delta = None
        for li, L in enumerate(self.layers):
            h, x = glue.add_norm(h, delta, L.in_norm)
            qkv = L.qkv(x)
            if lora is not None:
                lora.add(li, "q_proj", x, qkv[:, :qs])
                lora.add(li, "k_proj", x, qkv[:, qs:ks])
                lora.add(li, "v_proj", x, qkv[:, ks:])
            q, k, v = glue.rope_store_kv(qkv, positions, cos, sin, kv_caches[li], meta)
            attn = attention(q, k, v, kv_caches[li], meta).reshape(T, qs)
            o = L.o(attn)
            if lora is not None:
                lora.add(li, "o_proj", attn, o)
            h, x = glue.add_norm(h, o, L.post_norm)
            gu = L.gate_up(x)
            if lora is not None:
                inter = self.cfg.intermediate_size
                lora.add(li, "gate_proj", x, gu[:, :inter])
                lora.add(li, "up_proj", x, gu[:, inter:])
            act = glue.silu_mul(gu)
            delta = L.down(act)
            if lora is not None:
                lora.add(li, "down_proj", act, delta)
        return glue.add_norm(h, delta, self.norm)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def sequence_logits(self, ids: list[int]) -> torch.Tensor:
        """The logits at every position of one sequence, in one prefill outside any engine (a scratch
        KV cache of its own): for calibrating and for measuring quality, not for serving. Attention reads
        K/V back from the cache, as a chunk after a cached prefix does, so that a 16-bit cache's rounding
        is in these logits too."""
        T, block = len(ids), 16
        kv = self.allocate_kv_cache(T // block + 2, block)
        blocks = torch.arange(1, (T + block - 1) // block + 1, device=self.device)
        causal = torch.arange(T, device=self.device).unsqueeze(0) <= torch.arange(T, device=self.device).unsqueeze(1)
        meta = AttentionMetadata(slot_mapping=torch.arange(block, block + T, device=self.device), num_decodes=0,
                                 decode_block_tables=None, decode_mask=None, decode_max_len=0,
                                 prefills=[PrefillChunk(0, T, T, blocks, causal)])
        with torch.inference_mode():
            hidden = self.forward(torch.tensor(ids, device=self.device), torch.arange(T, device=self.device),
                                  meta, kv)
            return self.compute_logits(hidden)

    # the quantization method's view of the model (quantization/methods.LoadedModel)
    def calibration_forward(self, ids: list[int]) -> None:
        self.sequence_logits(ids)

    def calibration_shape(self) -> tuple[int, int]:
        return self.cfg.vocab_size, self.cfg.max_position_embeddings
