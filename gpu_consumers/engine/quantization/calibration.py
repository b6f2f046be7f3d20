"""Calibration for int8 weights: the text the engine calibrates on, and InputRecorder, the projection the
int8 method loads in place of each one it quantizes, which multiplies in float while it keeps the running
per-channel largest magnitude of its input (for Int8Linear's smoothing)."""
from __future__ import annotations

import logging
import random
from importlib import resources

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 1024


def calibration_text() -> str:
    """The text the engine calibrates int8 weights on (shipped with the package)."""
    return resources.files(__package__).joinpath("calibration.txt").read_text(encoding="utf-8")


def calibration_tokens(calibration_ids: list[int] | None, vocab_size: int, max_positions: int) -> list[int]:
    """The tokens of the calibration forward. None (no tokenizer) falls back to random tokens, which
    calibrate worse (measured: lower agreement with fp32), with a warning."""
    if calibration_ids is None:
        log.warning("int8 weights calibrated on random tokens (no tokenizer): expect lower quality")
        rng = random.Random(0)
        calibration_ids = [rng.randrange(vocab_size) for _ in range(CALIBRATION_TOKENS)]
    return calibration_ids[:min(CALIBRATION_TOKENS, max_positions)]


class InputRecorder:
    """A float projection that records the per-channel max |input| of every call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.absmax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
        self.absmax = m if self.absmax is None else torch.maximum(self.absmax, m)
        return F.linear(x, self.weight, self.bias)

    def numel(self) -> int:
        return self.weight.numel() + (self.bias.numel() if self.bias is not None else 0)
