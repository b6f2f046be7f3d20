"""Fixtures: tiny randomly initialised HF checkpoints and an offline byte-level BPE tokenizer."""

from __future__ import annotations


import pytest

from engine_test_models import MODEL_KINDS, build_model


@pytest.fixture(autouse=True, scope="session")
def kernel_argument_checks():
    """Every C kernel call of the engine tests has its arguments checked (the kernels check no bounds)."""
    from gpu_consumers.engine.kernels.native_library import ArgumentChecks

    ArgumentChecks.enabled = True
    yield
    ArgumentChecks.enabled = False


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
