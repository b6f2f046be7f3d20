"""What PEFT itself generates with a LoRA adapter: the reference the engine's and the stack's adapter
answers are held to."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def peft_greedy(base_dir: str, adapter_dir: str | None, prompts, max_new: int,
                stop_at_eos: bool = False) -> list[list[int]]:
    """PEFT's (unmerged) greedy tokens, one prompt at a time; adapter_dir None: transformers alone."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            extra = {} if stop_at_eos else {"min_new_tokens": max_new, "pad_token_id": 0}
            gen = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new, do_sample=False, **extra)
            out.append(gen[0, len(p):].tolist())
    return out
