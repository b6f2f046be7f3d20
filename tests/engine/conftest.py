"""Fixtures: tiny randomly initialised HF checkpoints and an offline byte-level BPE tokenizer."""

from __future__ import annotations


import pytest
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


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {k: build_model(k, str(root / k)) for k in MODEL_KINDS}


def build_tokenizer(path: str):
    """Byte-level BPE trained offline on a small corpus with multi-byte characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "hello world, the quick brown fox jumps over the lazy dog.",
        "héllo wörld — naïve café, déjà vu; 日本語のテキスト, 中文字符, emoji 🙂🚀🎉.",
        "stop here. STOP! end of text. 1234567890 + - * / = ?",
    ] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="session")
def tok_model_dir(tmp_path_factory) -> str:
    """A tiny llama + byte-level BPE tokenizer saved in one directory."""
    root = str(tmp_path_factory.mktemp("tokmodel"))
    build_model("llama-gqa-rope3", root, vocab_size=512)
    build_tokenizer(root)
    return root
