"""Quantization methods: which projection object each of a model's weights becomes, decided once when
the model loads. A method makes each projection from its loaded weight (`create_linear`) and finishes the
model once every weight is loaded (`process_after_loading`); the projections then apply themselves.

Int8Method: q/k/v, o, gate/up and the LM head in int8 (Int8Linear, the head as Int8Head: its top
candidates re-scored in float) after one calibration forward; down_proj stays in float. Its input
(SiLU(gate) * up) carries the largest outlier channels, and measured on SmolLM2 (docs/benchmarks.md)
quantizing it alone cost more greedy agreement with fp32 than all the others together."""
from __future__ import annotations

from typing import Protocol

import torch

from ..layers.linear import Linear, float_linear, pack_float_linear
from .calibration import InputRecorder, calibration_tokens
from .int8_head import Int8Head
from .int8_linear import Int8Linear

# the decoder layer's projections (model/decoder_layer.py) the int8 method quantizes
INT8_PROJECTIONS = ("qkv", "o", "gate_up")
# The head's input (the final norm's output) smooths best at a milder strength than the layers' 0.7:
# 95.8% greedy agreement for the head alone at 0.5 (and 0.3) against 93.3% at 0.85 and 94.3% unsmoothed.
HEAD_SMOOTHING_ALPHA = 0.5


class LoadedModel(Protocol):
    """What a method finishes: the model's projections (decoder layers' and the head) and a forward."""
    layers: list
    lm_head: Linear

    def calibration_forward(self, ids: list[int]) -> None: ...

    def calibration_shape(self) -> tuple[int, int]: ...


class UnquantizedMethod:
    """Float weights, in oneDNN's layout where its product runs (layers/onednn.py)."""

    def __init__(self, use_onednn: bool) -> None:
        self.use_onednn = use_onednn

    def create_linear(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return float_linear(weight, bias, self.use_onednn)

    def process_after_loading(self, model: LoadedModel, calibration_ids: list[int] | None) -> None:
        """Packs the float projections (and the LM head: for a tied one a packed copy, the embedding
        stays plain for lookups)."""
        for layer in model.layers:
            for name in layer.projection_names():
                setattr(layer, name, pack_float_linear(getattr(layer, name)))
        model.lm_head = pack_float_linear(model.lm_head)


class Int8Method(UnquantizedMethod):
    def create_linear(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        if name in INT8_PROJECTIONS or name == "lm_head":
            return InputRecorder(weight, bias)
        return super().create_linear(name, weight, bias)

    def process_after_loading(self, model: LoadedModel, calibration_ids: list[int] | None) -> None:
        """One calibration forward through the recorders, then each becomes its int8 projection; the
        float ones are packed after, since the calibration forward reads them plain."""
        vocab_size, max_positions = model.calibration_shape()
        model.calibration_forward(calibration_tokens(calibration_ids, vocab_size, max_positions))
        for layer in model.layers:
            for name in INT8_PROJECTIONS:
                rec = getattr(layer, name)
                setattr(layer, name, Int8Linear(rec.weight, rec.bias, rec.absmax))
        head = model.lm_head
        assert isinstance(head, InputRecorder)
        model.lm_head = Int8Head(head.weight, head.absmax, alpha=HEAD_SMOOTHING_ALPHA)
        super().process_after_loading(model, calibration_ids)


def quantization_method(quantization: str | None, use_onednn: bool) -> UnquantizedMethod:
    """The method of EngineConfig.quantization (None or one of config.QUANTIZATIONS)."""
    if quantization == "int8":
        return Int8Method(use_onednn)
    if quantization is None:
        return UnquantizedMethod(use_onednn)
    raise ValueError(f"unknown quantization {quantization!r}")
