"""Tiny randomly initialised HF checkpoints for the engine tests.

Kept out of conftest.py so test modules can import it by a name no other test folder uses
(every test folder's conftest is a module called `conftest`).
"""
from __future__ import annotations

import torch


def _scale_init(model, std: float) -> None:
    # Larger weights give peaky logits, so greedy argmax is not decided by float noise.
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:  # norms
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


def build_model(kind: str, path: str, vocab_size: int = 512) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    if kind == "llama-gqa-rope3":
        cfg = LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                          rope_theta=500000.0)
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen2-bias":
        cfg = Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=1)
        model = Qwen2ForCausalLM(cfg)
    elif kind == "llama-tied":
        cfg = LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                          head_dim=32)
        model = LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = MistralConfig(**common, num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
        model = MistralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    _scale_init(model, 0.12)
    if kind == "llama-tied":
        model.tie_weights()
    model.eval()
    model.save_pretrained(path)
    return path


MODEL_KINDS = ["llama-gqa-rope3", "qwen2-bias", "llama-tied"]
