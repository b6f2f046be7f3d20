"""Builds tokenmill's default model: a small random Llama with a locally trained tokenizer.

No weights can be downloaded here, so the default run and the tests use a model made
on the spot and saved as an ordinary Hugging Face checkpoint directory. Its text is
gibberish, but every code path (tokenizer, chat template, safetensors, engine) is real.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "tiny": (128, 2, 4, 2, 384, 2048),
    "small": (512, 8, 8, 4, 1536, 8192),
}

# Tools are listed in a system turn; calls in the history are spelled as the model must answer them
# (ingress/serving/tool_calls.py). Without tools it renders exactly as it did before tools existed.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nYou may call these tools. To call one, answer with "
    "<tool_call>{\"name\": NAME, \"arguments\": ARGUMENTS}</tool_call>.\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] }}}</tool_call>"
    "{% endfor %}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _corpus() -> list[str]:
    """Offline training text: the docstrings and source of Python's own standard library."""
    stdlib = Path(json.__file__).resolve().parent.parent
    texts = []
    for path in sorted(stdlib.glob("*.py"))[:400]:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    texts.append("Héllo wörld — naïve café, 日本語のテキスト, emoji 🎉🚀, Ελληνικά, русский текст.")
    return texts


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_default_model(out_dir: str | Path, size: str = "small", seed: int = 0,
                        max_position_embeddings: int = 2048) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        template = out / "chat_template.jinja"
        if template.exists() and template.read_text() != CHAT_TEMPLATE:
            template.write_text(CHAT_TEMPLATE)  # a model built before the template learned tools
        return out
    hidden, layers, heads, kv_heads, inter, vocab = SIZES[size]
    tokenizer = build_tokenizer(vocab)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
        max_position_embeddings=max_position_embeddings, rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>")],
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Written beside and renamed into place: processes that build it at once (pytest's workers, a
    # benchmark beside them) never load a half-written checkpoint, and the first to finish wins.
    out.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(building, safe_serialization=True)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(building)
        tokenizer.save_pretrained(building)
        try:
            building.rename(out)
        except OSError:  # another process finished first (or an empty folder is in the way)
            if not (out / "config.json").exists():
                out.rmdir()
                building.rename(out)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(build_default_model(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "small"))
