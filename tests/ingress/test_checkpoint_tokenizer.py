"""The cheap tokenizer load gives what AutoTokenizer gives, and leaves every other checkpoint to it."""
import json
import shutil

import pytest
from transformers import AutoTokenizer

from ingress.serving.checkpoint_tokenizer import declares_generic_fast_tokenizer, load_tokenizer

TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n", "héllo 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture(params=["tiny", "real"])
def checkpoint(request, tiny_model_dir):
    return tiny_model_dir if request.param == "tiny" else request.getfixturevalue("real_model_dir")


def test_both_of_tokenmills_checkpoints_load_the_class_autotokenizer_gives_with_the_same_behaviour(checkpoint):
    assert declares_generic_fast_tokenizer(checkpoint)
    cheap, auto = load_tokenizer(checkpoint), AutoTokenizer.from_pretrained(str(checkpoint))
    assert type(cheap) is type(auto)
    assert cheap.get_vocab() == auto.get_vocab()
    assert cheap.all_special_tokens == auto.all_special_tokens and cheap.eos_token_id == auto.eos_token_id
    assert cheap.chat_template == auto.chat_template
    for text in TEXTS:
        ids = auto.encode(text)
        assert cheap.encode(text) == ids
        assert cheap.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert (cheap.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


@pytest.mark.parametrize("change", ["a model-specific class", "custom code", "no tokenizer.json", "unreadable config"])
def test_any_other_checkpoint_is_left_to_autotokenizer(tmp_path, tiny_model_dir, change):
    directory = tmp_path / "checkpoint"
    shutil.copytree(tiny_model_dir, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if change == "a model-specific class":
        config["tokenizer_class"] = "LlamaTokenizer"
    elif change == "custom code":
        config["auto_map"] = {"AutoTokenizer": ["tokenization_mine.MyTokenizer", None]}
    elif change == "no tokenizer.json":
        (directory / "tokenizer.json").unlink()
    config_path.write_text("{not json" if change == "unreadable config" else json.dumps(config))
    assert not declares_generic_fast_tokenizer(directory)
