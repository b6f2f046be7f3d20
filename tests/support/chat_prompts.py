"""Questions rendered as the real model's own chat template would send them: the prompts the
real-model tests hold the engine and the stack to."""
from __future__ import annotations

from transformers import AutoTokenizer


def chat_prompts(model_dir, questions: list[str]) -> list[list[int]]:
    """Token ids of each question as one user turn, ready for the assistant's answer."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in questions]
