"""What PEFT itself generates with a LoRA adapter: the reference the engine's and the stack's adapter
answers are held to."""
from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
from transformers import AutoModelForCausalLM


def peft_greedy(base_dir: str, adapter_dir: str | None, prompts, max_new: int,
                stop_at_eos: bool = False) -> list[list[int]]:
    """PEFT's (unmerged) greedy tokens, one prompt at a time; adapter_dir None: transformers alone."""
    return peft_greedy_each(base_dir, {None: adapter_dir}, prompts, max_new, stop_at_eos)[None]


def peft_greedy_each(base_dir: str, adapter_dirs: Mapping[Hashable, str | None], prompts, max_new: int,
                     stop_at_eos: bool = False) -> dict[Hashable, list[list[int]]]:
    """`peft_greedy` for several adapters (None: the base model) on one loaded base model: each adapter is
    added to the one PeftModel and made the active one, the base model answers with adapters disabled."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    names = {key: f"adapter-{i}" for i, (key, path) in enumerate(adapter_dirs.items()) if path is not None}
    for key, name in names.items():
        if isinstance(model, PeftModel):
            model.load_adapter(adapter_dirs[key], adapter_name=name)
        else:
            model = PeftModel.from_pretrained(model, adapter_dirs[key], adapter_name=name).eval()

    def generate() -> list[list[int]]:
        out = []
        for p in prompts:
            extra = {} if stop_at_eos else {"min_new_tokens": max_new, "pad_token_id": 0}
            gen = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new, do_sample=False, **extra)
            out.append(gen[0, len(p):].tolist())
        return out

    refs: dict[Hashable, list[list[int]]] = {}
    with torch.no_grad():
        for key in adapter_dirs:
            if key in names:
                model.set_adapter(names[key])
                refs[key] = generate()
            elif isinstance(model, PeftModel):
                with model.disable_adapter():
                    refs[key] = generate()
            else:
                refs[key] = generate()
    return refs
