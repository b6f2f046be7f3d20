"""Random non-zero PEFT LoRA adapters for tests: adapter_config.json + adapter_model.safetensors, as PEFT
writes them, for a base checkpoint's config.json (its layer count and projection sizes)."""
from __future__ import annotations

import json
from pathlib import Path

MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def projection_sizes(cfg: dict) -> dict[str, tuple[int, int]]:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv = (cfg.get("num_key_value_heads") or heads) * head_dim
    h, i, q = cfg["hidden_size"], cfg["intermediate_size"], heads * head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def adapter_tensors(base_config: dict, rank: int = 8, targets=("q_proj", "v_proj"), seed: int = 0,
                    scale: float = 0.05, dtype=None) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    sizes = projection_sizes(base_config)
    out = {}
    for layer in range(base_config["num_hidden_layers"]):
        for module in targets:
            fan_in, fan_out = sizes[module]
            prefix = f"base_model.model.model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
            out[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * scale).to(dtype or torch.float32)
            out[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * scale).to(dtype or torch.float32)
    return out


def adapter_config(rank: int = 8, targets=("q_proj", "v_proj"), alpha: int = 16, **extra) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "target_modules": list(targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False, **extra}


def safetensors_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()})


def write_adapter(out: Path, base_dir: Path, rank: int = 8, targets=("q_proj", "v_proj"), seed: int = 0,
                  scale: float = 0.05) -> Path:
    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(rank, targets)))
    (out / "adapter_model.safetensors").write_bytes(safetensors_bytes(adapter_tensors(cfg, rank, targets, seed, scale)))
    return out
