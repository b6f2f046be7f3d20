"""Own Llama-family forward pass (Llama / Llama-3 rope scaling, Mistral, Qwen2).

Tokens of many sequences (prefill chunks and decodes) are packed into ONE forward
with per-token positions.  K/V of every token is written into a preallocated
paged KV pool (one tensor per layer, shape [2, num_blocks, block_size, kv_heads,
head_dim]) at its slot, and attention reads the sequence's context back through
its block table.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.fx.experimental._config
import torch.nn.functional as F

from . import float_linear
from .native_decode_attention import native_decode_attention
from .native_layer_ops import NativeLayerOps, native_layer_ops
from .int8_calibration import quantize_int8

if TYPE_CHECKING:
    from .int8_head import Int8Head
    from .lora_slots import LoraBatch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
log = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_theta: float
    rope_scaling: dict | None
    eos_token_ids: list[int]

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        mt = cfg.get("model_type", "llama")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {mt!r}; supported: {SUPPORTED_MODEL_TYPES}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}")
        nh = cfg["num_attention_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
        # transformers 5 writes rope_parameters; older configs use rope_theta + rope_scaling
        rp = cfg.get("rope_parameters") or {}
        if isinstance(rp, dict) and "rope_theta" not in rp and rp and all(isinstance(v, dict) for v in rp.values()):
            rp = next(iter(rp.values()))  # per-layer-type dict: take the full-attention one
        theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or None
        if rp.get("rope_type", "default") != "default":
            scaling = rp
        if scaling is not None:
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype == "default":
                scaling = None
            elif rtype not in ("llama3", "linear"):
                raise ValueError(f"unsupported rope scaling type {rtype!r}")
        if mt == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        max_pos = cfg.get("max_position_embeddings", 2048)
        return cls(
            model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=nh, num_kv_heads=cfg.get("num_key_value_heads") or nh, head_dim=hd,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_theta=float(theta), rope_scaling=scaling, eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_dict(json.load(f))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
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


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [fn for fn in sorted(os.listdir(path)) if fn.endswith(".safetensors")]
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    sd: dict[str, torch.Tensor] = {}
    for fn in files:
        sd.update(load_file(os.path.join(path, fn)))
    return sd


class PrefillChunk(NamedTuple):
    """One sequence's prefill chunk in the flat batch: rows [start, end), attending over ctx_len
    tokens of context."""
    start: int
    end: int
    ctx_len: int
    # None (with mask None): no earlier context, attend causally over the chunk's own K/V
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one packed batch (built by ModelRunner).

    Decode tokens come first in the flat batch (rows [0, num_decodes)), followed by
    prefill chunks."""

    slot_mapping: torch.Tensor  # [T] flat slot index (block * block_size + offset)
    num_decodes: int
    # decodes: padded block tables and key mask (None when all contexts are equal)
    decode_block_tables: torch.Tensor | None  # [D, max_blocks]
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool
    decode_max_len: int
    prefills: list[PrefillChunk]
    # decodes' context lengths [D]; when set, decode attention runs the compiled paged kernel
    # (paged_decode_attention) instead of gathering each sequence's blocks into a padded copy
    decode_lens: torch.Tensor | None = None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context, read through its block table.

    q [D, kv_heads, group, head_dim]; k_cache / v_cache [num_blocks, block_size, kv_heads, head_dim];
    block_tables [D, blocks] (padding entries may name any block: positions >= lens are masked);
    lens [D] context lengths. Returns [D, kv_heads, group, head_dim].

    Written as indexing, products and reductions so that inductor (torch.compile) fuses the block-table
    gather into the score and value reductions: the compiled kernel reads each K/V block where it lies
    in the cache, with no padded per-layer copy of the context. Eagerly it gathers, as SDPA's path did.
    """
    D, nbk = block_tables.shape
    bs = k_cache.shape[1]
    k = k_cache[block_tables]  # [D, nbk, bs, kvh, hd]
    v = v_cache[block_tables]
    s = (q.unsqueeze(1).unsqueeze(1) * k.unsqueeze(4)).sum(-1) * (q.shape[-1] ** -0.5)  # [D, nbk, bs, kvh, g]
    pos = torch.arange(nbk * bs, device=q.device).view(1, nbk, bs, 1, 1)
    s = s.masked_fill(pos >= lens.view(D, 1, 1, 1, 1), float("-inf"))
    m = s.amax(dim=(1, 2), keepdim=True)
    p = torch.exp(s - m)
    den = p.sum(dim=(1, 2))  # [D, kvh, g]
    o = (p.unsqueeze(-1) * v.unsqueeze(4)).sum(dim=(1, 2))  # [D, kvh, g, hd]
    return o / den.unsqueeze(-1)


class _CompiledDecodeAttention:
    """paged_decode_attention under torch.compile (dynamic shapes: one graph serves every batch size and
    context length, with graphs of their own for a batch of one and a context of one block).

    `prepare` builds the graphs for a model's head shape and dtype in a background thread, and until
    they are built every call answers None, i.e. the caller's eager path runs: a worker serves from its
    first request while the compile (tens of seconds on a busy 2-core machine) goes on beside it.
    `wait` blocks until the graphs are built (benchmarks, Engine.warmup). A failure to compile (no C++
    compiler, an unsupported backend) is logged once and the eager path is used from then on."""

    def __init__(self) -> None:
        self.fn = None
        self.failed: str | None = None
        self.compile_s: float | None = None
        self._ready: set = set()
        self._threads: dict = {}
        self._lock = threading.Lock()

    def _call(self, *args):
        # No duck sizing: a batch or block count that happens to equal another size at the first
        # trace (the cache's K/V dim of 2, the block size) would become a guard, and every later
        # step that breaks it a recompile.
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return self.fn(*args)

    def prepare(self, key: tuple, block_size: int) -> None:
        """Start building the graphs for key = (kv_heads, group, head_dim, query dtype, KV cache dtype, device)."""
        with self._lock:
            if self.failed is not None or key in self._ready or key in self._threads:
                return
            if self.fn is None:
                self.fn = torch.compile(paged_decode_attention, dynamic=True)
            t = threading.Thread(target=self._build, args=(key, block_size), daemon=False,
                                 name="tokenmill-compile-decode")
            self._threads[key] = t
        t.start()

    def _build(self, key: tuple, block_size: int) -> None:
        kvh, g, hd, dtype, kv_dtype, device = key
        t0 = time.perf_counter()
        try:
            # The inputs are made as the engine's are: the cache outside inference mode, as two halves of
            # one tensor, the rest inside. A graph is guarded on its inputs' dispatch keys and on whether K
            # and V are one tensor; warming on one inference-mode tensor for both built four graphs no step
            # used, the steps compiled more, and with a second cache dtype in the process dynamo's limit of
            # 8 graphs was hit and that engine's decode ran the slow eager form (measured 105 vs 65 ms).
            cache = torch.zeros(2, 5, block_size, kvh, hd, dtype=kv_dtype, device=device)
            with torch.inference_mode():
                for D in (1, 3):
                    for nbk in (1, 2):
                        self._call(torch.zeros(D, kvh, g, hd, dtype=dtype, device=device), cache[0], cache[1],
                                   torch.zeros(D, nbk, dtype=torch.long, device=device),
                                   torch.ones(D, dtype=torch.long, device=device))
        except Exception as exc:  # inductor's errors share no base class
            if "interpreter shutdown" in str(exc):
                return  # the process is exiting (the thread is not a daemon: a daemon's C++ threads abort it)
            self.failed = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            log.warning("compiled paged decode attention unavailable, using the eager path: %s", self.failed)
            return
        self.compile_s = time.perf_counter() - t0
        log.info("compiled paged decode attention in %.1f s", self.compile_s)
        with self._lock:
            self._ready.add(key)

    def wait(self, key: tuple | None = None) -> None:
        for k, t in list(self._threads.items()):
            if key is None or k == key:
                t.join()

    def __call__(self, q, k_cache, v_cache, block_tables, lens, wait: bool = False) -> torch.Tensor | None:
        D, kvh, g, hd = q.shape
        key = (kvh, g, hd, q.dtype, k_cache.dtype, q.device.type)
        if key not in self._ready:
            if self.failed is not None:
                return None
            self.prepare(key, k_cache.shape[1])
            if not wait:
                return None
            self.wait(key)
            if key not in self._ready:
                return None
        try:
            return self._call(q, k_cache, v_cache, block_tables, lens)
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            log.warning("compiled paged decode attention failed, using the eager path: %s", self.failed)
            return None


compiled_decode_attention = _CompiledDecodeAttention()


QUANTIZATIONS = ("int8",)
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LlamaForCausalLM:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device) -> None:
        self.cfg = cfg
        self.dtype = dtype
        # the KV cache's element type: the weights' dtype unless from_pretrained's kv_cache_dtype says otherwise
        self.kv_cache_dtype = dtype
        self.device = torch.device(device)
        self.quantization: str | None = None
        # the float projections' product: oneDNN for float32 on CPU (float_linear.py says why)
        self.float_linear = float_linear.for_weights(dtype, self.device)
        # the operations between the products as C calls where they apply (native_layer_ops.py); off: torch's
        self.native_layer_ops = True

        def w(name):
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        def opt(name):
            return w(name) if name in weights else None

        self.embed = w("model.embed_tokens.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            qkv_w = torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")], 0)
            qkv_b = None
            if cfg.qkv_bias:
                qkv_b = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")], 0)
            gu_w = torch.cat([w(m + "gate_proj.weight"), w(m + "up_proj.weight")], 0)
            gu_b = None
            if cfg.mlp_bias:
                gu_b = torch.cat([w(m + "gate_proj.bias"), w(m + "up_proj.bias")], 0)
            self.layers.append(dict(
                in_norm=w(p + "input_layernorm.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                qkv_w=qkv_w, qkv_b=qkv_b,
                o_w=w(a + "o_proj.weight"), o_b=opt(a + "o_proj.bias") if cfg.o_bias else None,
                gu_w=gu_w, gu_b=gu_b,
                down_w=w(m + "down_proj.weight"), down_b=opt(m + "down_proj.bias") if cfg.mlp_bias else None,
            ))
        self.norm = w("model.norm.weight")
        self.lm_head: torch.Tensor | Int8Head
        self.tied_lm_head = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        if self.tied_lm_head:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")
        inv_freq = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], -1)
        self.cos = emb.cos().to(device=self.device, dtype=dtype)
        self.sin = emb.sin().to(device=self.device, dtype=dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @classmethod
    def from_pretrained(cls, path: str, dtype=torch.float32, device="cpu", quantization: str | None = None,
                        calibration_ids: list[int] | None = None,
                        kv_cache_dtype: torch.dtype | None = None) -> "LlamaForCausalLM":
        """`quantization`: None (weights in `dtype`) or "int8": q/k/v, o, gate/up and the LM head as int8
        through torch's dynamic-quantized GEMM, calibrated on `calibration_ids` (int8_calibration.py);
        norms, the embedding, down_proj, attention and the KV cache stay in `dtype`. `kv_cache_dtype`:
        the KV cache's element type when not `dtype` (KV_CACHE_DTYPES: 16 bits halve the cache's memory;
        attention still computes in `dtype`)."""
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES.values():
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)} or None, not {kv_cache_dtype!r}")
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, not {quantization!r}")
        model = cls(ModelConfig.from_pretrained(path), _load_state_dict(path), dtype, device)
        if kv_cache_dtype is not None:
            model.kv_cache_dtype = kv_cache_dtype
        if quantization == "int8":
            quantize_int8(model, calibration_ids)
            model.quantization = quantization
        model.pack_float_weights()
        return model

    def pack_float_weights(self) -> None:
        """The float projections (and the LM head) in oneDNN's layout where the engine's product is oneDNN's
        (float_linear.py); quantized ones stay as they are. After calibration, which reads the plain ones."""
        if self.float_linear is not float_linear.onednn_linear:
            return
        for L in self.layers:
            for key in ("qkv_w", "o_w", "gu_w", "down_w"):
                if isinstance(L[key], torch.Tensor):
                    L[key] = float_linear.pack(L[key])
        if isinstance(self.lm_head, torch.Tensor):
            self.lm_head = float_linear.pack(self.lm_head)  # tied: a packed copy, the embedding stays for lookups

    def num_params(self) -> int:
        n = self.embed.numel() + self.norm.numel()
        if not self.tied_lm_head:
            n += self.lm_head.numel()
        for L in self.layers:
            n += sum(t.numel() for t in L.values() if t is not None)
        return n

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
    def _linear(self, x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
        """A projection: a float weight, or a callable that holds its own (Int8Linear, with its bias)."""
        if isinstance(w, torch.Tensor):
            return self.float_linear(x, w, b)
        return w(x)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # the same arithmetic as below in one call (bitwise equal on CPU): at batch 1 a decode step
            # beyond its matrix products is mostly the dispatch of small ops, 61 norms of ~8 ops each
            return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return w * (xf * torch.rsqrt(var + self.cfg.rms_norm_eps)).to(x.dtype)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; cos/sin: [T, 1, D]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], lora: "LoraBatch | None" = None) -> torch.Tensor:
        """Returns final-norm hidden states [T, hidden]. ``lora``: the step's adapters (lora_slots.py);
        each targeted projection adds its LoRA delta for the whole batch at once.

        Each residual add is carried to the norm after it (`_add_norm`), so that where the C layer ops apply
        (float32 on CPU, native_layer_ops.py) the add and the norm are one call, as are rope with the
        KV-cache write and SwiGLU; elsewhere they are the same torch operations as always."""
        c = self.cfg
        T = input_ids.shape[0]
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        ops = native_layer_ops if self.native_layer_ops and native_layer_ops.applies(
            self.dtype, self.kv_cache_dtype, self.device.type) else None
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        h = F.embedding(input_ids, self.embed)
        delta = None
        for li, L in enumerate(self.layers):
            h, x = self._add_norm(h, delta, L["in_norm"], ops)
            qkv = self._linear(x, L["qkv_w"], L["qkv_b"])
            if lora is not None:
                qs, ks = self.q_size, self.q_size + self.kv_size
                lora.add(li, "q_proj", x, qkv[:, :qs])
                lora.add(li, "k_proj", x, qkv[:, qs:ks])
                lora.add(li, "v_proj", x, qkv[:, ks:])
            fused = ops is not None and qkv.is_contiguous()
            if fused:
                ops.rope_store_kv(qkv, self.cos, self.sin, positions, nh, nkv, hd, kv_caches[li], meta.slot_mapping)
                q = qkv[:, :self.q_size].view(T, nh, hd)
                k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, nkv, hd)
            else:  # q and k rotated in one pass (the same elementwise arithmetic, half the ops)
                qk = self.rope(qkv[:, :self.q_size + self.kv_size].view(T, nh + nkv, hd), cos, sin)
                q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, self.q_size + self.kv_size:].view(T, nkv, hd)
            if not fused:
                self.store_kv(k, v, kv_caches[li], meta)
            attn = self.attend(q, k, v, kv_caches[li], meta)
            attn2 = attn.reshape(T, nh * hd)
            o = self._linear(attn2, L["o_w"], L["o_b"])
            if lora is not None:
                lora.add(li, "o_proj", attn2, o)
            h, x = self._add_norm(h, o, L["post_norm"], ops)
            gu = self._linear(x, L["gu_w"], L["gu_b"])
            if lora is not None:
                inter = c.intermediate_size
                lora.add(li, "gate_proj", x, gu[:, :inter])
                lora.add(li, "up_proj", x, gu[:, inter:])
            if ops is not None and gu.is_contiguous():
                act = ops.silu_mul(gu)
            else:
                g, u = gu.chunk(2, -1)
                act = F.silu(g) * u
            delta = self._linear(act, L["down_w"], L["down_b"])
            if lora is not None:
                lora.add(li, "down_proj", act, delta)
        return self._add_norm(h, delta, self.norm, ops)[1]

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
                  ops: NativeLayerOps | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm(h + delta) * w); the C call adds into h in place."""
        if ops is not None:
            return h, ops.add_rms_norm(h, delta, w, self.cfg.rms_norm_eps)
        if delta is not None:
            h = h + delta
        return h, self.rms_norm(h, w)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Writes this step's K/V into the paged cache at their slots, then attends (store_kv, attend)."""
        self.store_kv(k, v, cache, meta)
        return self.attend(q, k, v, cache, meta)

    @staticmethod
    def store_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> None:
        nkv, hd = k.shape[1], k.shape[2]
        nb, bs = cache.shape[1], cache.shape[2]
        cache[0].view(nb * bs, nkv, hd).index_copy_(0, meta.slot_mapping, k.to(cache.dtype))
        cache[1].view(nb * bs, nkv, hd).index_copy_(0, meta.slot_mapping, v.to(cache.dtype))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Attention over a cache that holds this step's K/V already: the decode rows (first) over the
        cache in place, each prefill chunk over its own tokens or, after a cached prefix, over its blocks.
        q: [T, nh, hd]; k, v: [T, nkv, hd]; returns [T, nh, hd]."""
        T, nh, hd = q.shape
        nkv = k.shape[1]
        bs = cache.shape[2]
        D = meta.num_decodes
        if D == T:
            return self._decode_attention(q, cache, meta)  # decodes only: no rows to assemble
        attn = torch.empty(T, nh, hd, dtype=q.dtype, device=q.device)
        if D:
            attn[:D] = self._decode_attention(q[:D], cache, meta)
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

    def _decode_attention(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        c = self.cfg
        D = q.shape[0]
        if meta.decode_lens is not None:
            o = native_decode_attention(q.view(D, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim),
                                        cache[0], cache[1], meta.decode_block_tables, meta.decode_lens)
            if o is not None:
                return o.view(D, c.num_heads, c.head_dim)
            q = q.contiguous()  # a slice of the rotated q|k rows; the compiled kernel's graphs take q whole
            o = compiled_decode_attention(q.view(D, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim),
                                          cache[0], cache[1], meta.decode_block_tables, meta.decode_lens)
            if o is not None:
                return o.view(D, c.num_heads, c.head_dim)
        bt = meta.decode_block_tables
        nbk = bt.shape[1]
        bs = cache.shape[2]
        L = meta.decode_max_len
        flat = bt.view(-1)
        ks = cache[0].index_select(0, flat).view(D, nbk * bs, c.num_kv_heads, c.head_dim)[:, :L].transpose(1, 2)
        vs = cache[1].index_select(0, flat).view(D, nbk * bs, c.num_kv_heads, c.head_dim)[:, :L].transpose(1, 2)
        ks, vs = ks.to(q.dtype), vs.to(q.dtype)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=meta.decode_mask,
                                           enable_gqa=c.num_heads != c.num_kv_heads)
        return o.squeeze(2)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden, self.lm_head, None)

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
