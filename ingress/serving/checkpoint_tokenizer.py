"""A checkpoint directory's tokenizer, loaded the cheap way when the checkpoint says which class it is.

`AutoTokenizer.from_pretrained` first resolves the model's config class, and importing transformers'
Llama config imports its activation, kernel-hub and model-loading modules, which import torch._dynamo and
torch.distributed.tensor: ~1.8 s of CPU at every worker and ingress start on a quiet 2-core machine
(several times that while other processes start beside it), only to build the same fast tokenizer. A
checkpoint whose tokenizer_config.json names the generic fast tokenizer (`TokenizersBackend`, formerly
`PreTrainedTokenizerFast`; what transformers saves for one, as for both of tokenmill's models), with a
tokenizer.json and no custom code, gets that class directly; every other checkpoint goes through
AutoTokenizer as before.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def declares_generic_fast_tokenizer(path: str | Path) -> bool:
    directory = Path(path)
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_FAST_CLASSES
            and "auto_map" not in config and (directory / "tokenizer.json").is_file())


def load_tokenizer(path: str | Path) -> Any:
    if declares_generic_fast_tokenizer(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
