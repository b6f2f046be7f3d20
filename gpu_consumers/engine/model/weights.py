"""Reading a checkpoint's weights (one or several .safetensors files)."""
from __future__ import annotations

import json
import os

import torch


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [fn for fn in sorted(os.listdir(path)) if fn.endswith(".safetensors")]
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    sd: dict[str, torch.Tensor] = {}
    for fn in files:
        sd.update(load_file(os.path.join(path, fn)))
    return sd
