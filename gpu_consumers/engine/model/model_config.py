"""ModelConfig: the shape of a Llama-family checkpoint (Llama / Llama-3 rope scaling, Mistral, Qwen2), read
from its config.json."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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
