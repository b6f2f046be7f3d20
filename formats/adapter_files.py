"""Validation of a PEFT LoRA adapter directory against a base model, with the standard library only.

Reads nothing but the given directory: ``adapter_config.json`` and the JSON header of
``adapter_model.safetensors`` (names, dtypes, shapes; never the tensor data). The engine runs it before
it loads an adapter, and the adapter registry can run the same checks at registration (it needs no
torch: ``BaseShapes.from_config_json`` takes the base checkpoint's config.json).

Every problem raises ``LoraLoadError`` (a ValueError) whose message names the file, the field or tensor,
and what is wrong with it.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
FLOAT_DTYPES = ("F32", "F16", "BF16")
# A safetensors header is a few kB per hundred tensors; anything near this is not an adapter.
MAX_HEADER_BYTES = 16 * 2**20
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
# Bounds that keep every adapter's weights finite in any float dtype a slot may have (float16's largest
# is 65504), far above what training produces (PEFT's scaling is lora_alpha / r, 0.25 to 32 in practice;
# trained weights are well under 10). Registration checks both, and the engine checks again after it
# folds the scaling into B (docs/lora.md, "Isolation").
MAX_LORA_SCALING = 1024.0
MAX_LORA_WEIGHT = 1e4

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_(A|B)(?:\.default)?\.weight$")


class LoraLoadError(ValueError):
    """An adapter that cannot be served: its message says which file, field or tensor and why."""


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: the base model's layer count and projection sizes."""
    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int
    kv_size: int

    @classmethod
    def from_model_config(cls, cfg) -> "BaseShapes":
        """From the engine's ModelConfig (or anything with its attribute names)."""
        return cls(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
                   cfg.num_kv_heads * cfg.head_dim)

    @classmethod
    def from_config_json(cls, cfg: dict) -> "BaseShapes":
        """From a Hugging Face config.json dict (Llama, Mistral, Qwen2)."""
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        return cls(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], heads * head_dim,
                   kv_heads * head_dim)

    def in_out(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
                "o_proj": (self.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter: its rank, the scaling PEFT applies (lora_alpha / r, or / sqrt(r) with
    rsLoRA), the modules it targets, and for each (layer, module) it adapts the names of its
    lora_A and lora_B tensors in the safetensors file."""
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    tensors: dict[tuple[int, str], tuple[str, str]]
    num_bytes: int


def validate_adapter_dir(path: str, base: BaseShapes, max_rank: int,
                         max_bytes: int | None = None) -> AdapterSpec:
    """Check the adapter directory at ``path`` against ``base``; raises LoraLoadError."""
    path = str(path)
    if not os.path.isdir(path):
        raise LoraLoadError(f"adapter directory {path!r} does not exist")
    config = read_adapter_config(path)
    rank, scaling, targets = check_config(config, max_rank)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        extra = " (adapter_model.bin is not read: only safetensors)" if os.path.exists(
            os.path.join(path, "adapter_model.bin")) else ""
        raise LoraLoadError(f"{path}: {WEIGHTS_FILE} is missing{extra}")
    size = os.path.getsize(weights)
    if max_bytes is not None and size > max_bytes:
        raise LoraLoadError(f"{weights}: {size} bytes is over the limit of {max_bytes}")
    header = read_safetensors_header(weights)
    tensors = check_tensors(header, rank, targets, base, weights)
    return AdapterSpec(path, rank, scaling, targets, tensors, size)


def read_adapter_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoraLoadError(f"{path}: {CONFIG_FILE} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraLoadError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraLoadError(f"{file}: not a JSON object")
    return config


def check_config(config: dict, max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    """(rank, scaling, target modules) of a PEFT LoraConfig dict; raises on anything the engine
    would serve differently from PEFT."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoraLoadError(f"{CONFIG_FILE}: peft_type {peft_type!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraLoadError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraLoadError(f"{CONFIG_FILE}: r={rank} is over the engine's max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraLoadError(f"{CONFIG_FILE}: lora_alpha must be a finite number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraLoadError(f"{CONFIG_FILE}: use_rslora must be true or false, got {rslora!r}")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    if abs(scaling) > MAX_LORA_SCALING:
        raise LoraLoadError(f"{CONFIG_FILE}: lora_alpha={alpha!r} gives a scaling of {scaling:g} "
                            f"(lora_alpha / {'sqrt(r)' if rslora else 'r'}), over the bound of {MAX_LORA_SCALING:g}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets == "all-linear":
            targets = list(TARGET_MODULES)
        elif targets in TARGET_MODULES:
            targets = [targets]
        else:
            raise LoraLoadError(f"{CONFIG_FILE}: target_modules {targets!r}: a regex is not supported, "
                                f"list module names among {list(TARGET_MODULES)}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoraLoadError(f"{CONFIG_FILE}: target_modules must be a non-empty list of module names")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise LoraLoadError(f"{CONFIG_FILE}: target_modules {unknown} are not projections of the base model "
                            f"(supported: {list(TARGET_MODULES)})")
    for field, ok in (("use_dora", lambda v: not v), ("fan_in_fan_out", lambda v: not v),
                      ("lora_bias", lambda v: not v), ("bias", lambda v: v in (None, "none")),
                      ("modules_to_save", lambda v: not v), ("rank_pattern", lambda v: not v),
                      ("alpha_pattern", lambda v: not v), ("layer_replication", lambda v: not v),
                      ("target_parameters", lambda v: not v), ("trainable_token_indices", lambda v: not v),
                      ("alora_invocation_tokens", lambda v: not v), ("use_qalora", lambda v: not v)):
        if field in config and not ok(config[field]):
            raise LoraLoadError(f"{CONFIG_FILE}: {field}={config[field]!r} is not supported")
    # layers_to_transform / exclude_modules need nothing here: the weights file holds exactly the
    # (layer, module) pairs that are adapted, and every other projection runs the base weights alone.
    return rank, float(scaling), tuple(t for t in TARGET_MODULES if t in targets)


def read_safetensors_header(file: str) -> dict:
    """The tensor entries of a safetensors file's header: name -> {"dtype", "shape", "data_offsets"}, held
    to the safetensors library's own rules (integer shapes and offsets, each tensor's bytes its shape times
    its dtype's size, the tensors back to back with no gap or overlap, covering the data exactly), so a
    header this accepts is one the library loads."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise LoraLoadError(f"{file}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise LoraLoadError(f"{file}: header of {n} bytes; not a safetensors adapter")
            text = f.read(n)
            f.seek(0, os.SEEK_END)
            data_len = f.tell() - 8 - n
    except OSError as exc:
        raise LoraLoadError(f"{file}: not readable ({exc})") from None
    if data_len < 0:
        raise LoraLoadError(f"{file}: its header runs past the end of the file (truncated)")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise LoraLoadError(f"{file}: its header is not JSON; not a safetensors file") from None
    if not isinstance(header, dict):
        raise LoraLoadError(f"{file}: its header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise LoraLoadError(f"{file}: its __metadata__ is not an object of strings")
    spans = []
    for name, entry in header.items():
        spans.append((_entry_span(file, name, entry, data_len), name))
    end = 0
    for (begin, stop), name in sorted(spans):
        if begin != end:
            raise LoraLoadError(f"{file}: tensor {name!r} starts at byte {begin} of the data, not at {end} "
                                f"(tensors overlap or leave a gap)")
        end = stop
    if end != data_len:
        raise LoraLoadError(f"{file}: the tensors end at byte {end} of {data_len} bytes of data")
    return header


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry_span(file: str, name: str, entry, data_len: int) -> tuple[int, int]:
    if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
            and all(_is_count(d) for d in entry["shape"]) and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2 and all(_is_count(o) for o in entry["data_offsets"])):
        raise LoraLoadError(f"{file}: tensor {name!r} has a malformed header entry")
    begin, stop = entry["data_offsets"]
    if stop > data_len:
        raise LoraLoadError(f"{file}: tensor {name!r} lies past the end of the file (truncated)")
    if begin > stop:
        raise LoraLoadError(f"{file}: tensor {name!r} ends before it begins")
    size = DTYPE_BYTES.get(entry["dtype"])
    if size is not None and stop - begin != math.prod(entry["shape"]) * size:
        raise LoraLoadError(f"{file}: tensor {name!r} holds {stop - begin} bytes, not the "
                            f"{math.prod(entry['shape']) * size} of shape {entry['shape']} in {entry['dtype']}")
    return begin, stop


def check_tensors(header: dict, rank: int, targets: tuple[str, ...], base: BaseShapes,
                  file: str = WEIGHTS_FILE) -> dict[tuple[int, str], tuple[str, str]]:
    """The (lora_A, lora_B) tensor names per (layer, module), after checking every name, dtype and
    shape against the rank and the base model."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, entry in header.items():
        m = _KEY.match(name)
        if m is None:
            raise LoraLoadError(f"{file}: tensor {name!r} is not a LoRA weight of a projection "
                                f"(expected base_model.model.model.layers.N.self_attn|mlp.<module>.lora_A|lora_B.weight)")
        layer, parent, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if (parent == "self_attn") != (module in ATTENTION_MODULES):
            raise LoraLoadError(f"{file}: tensor {name!r}: {module} is not under {parent}")
        if layer >= base.num_layers:
            raise LoraLoadError(f"{file}: tensor {name!r}: layer {layer} but the base model has "
                                f"{base.num_layers} layers")
        if module not in targets:
            raise LoraLoadError(f"{file}: tensor {name!r}: {module} is not in the config's target_modules")
        if entry.get("dtype") not in FLOAT_DTYPES:
            raise LoraLoadError(f"{file}: tensor {name!r} has dtype {entry.get('dtype')!r}; "
                                f"expected one of {list(FLOAT_DTYPES)}")
        fan_in, fan_out = base.in_out(module)
        want = [rank, fan_in] if which == "A" else [fan_out, rank]
        if entry["shape"] != want:
            raise LoraLoadError(f"{file}: tensor {name!r} has shape {entry['shape']}, expected {want} "
                                f"(r={rank}, {module} is {fan_in}->{fan_out} in the base model)")
        pair = found.setdefault((layer, module), {})
        if which in pair:
            raise LoraLoadError(f"{file}: two lora_{which} tensors for layer {layer} {module}")
        pair[which] = name
    if not found:
        raise LoraLoadError(f"{file}: holds no LoRA weights")
    out = {}
    for (layer, module), pair in sorted(found.items()):
        if len(pair) != 2:
            missing = "B" if "A" in pair else "A"
            raise LoraLoadError(f"{file}: layer {layer} {module} has no lora_{missing} tensor")
        out[(layer, module)] = (pair["A"], pair["B"])
    return out
