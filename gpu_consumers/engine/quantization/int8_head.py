"""Int8Head: the LM head in int8, with each row's top candidates re-scored in float.

The head is the largest projection of a small model (SmolLM2: 576 x 49,152, a fifth of its weights) and
int8 makes it 4-8x faster, but its rounding alone moved the greedy token at ~5% of positions (measured
on SmolLM2, docs/benchmarks.md). The winners are decided among a handful of near-tied logits, so the
int8 product only picks the CANDIDATES top candidates per row and their logits are recomputed from the
float weight: CANDIDATES dot products per row, next to the int8 head's 49,152. Greedy decoding then
agrees with float32's head whenever float32's best token is among int8's best CANDIDATES (it was at
every position measured), and the logits that decide sampling and top logprobs are float32's own; the
tail of the distribution stays int8's.

The float weight is the one the model already holds (a tied head's is the embedding), so this costs
no memory for tied models.
"""
from __future__ import annotations

import torch

from .int8_linear import Int8Linear

CANDIDATES = 4
# top_candidates' block width: vocabulary-sized rows are reduced 128 values at a time
BLOCK = 128


def top_candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest values (in no particular order), as torch.topk gives them but
    ~7x faster on a vocabulary-wide row on CPU (measured: M=16 rows of 49,152, 0.14 ms against 0.91 ms):
    the k best blocks by their maximum must hold the k best values, so topk runs over block maxima and
    then over those k blocks only."""
    rows, vocab = logits.shape
    if vocab < k * BLOCK:  # fewer blocks than candidates: nothing to gain
        return logits.topk(k, dim=-1).indices
    if vocab % BLOCK:
        logits = torch.nn.functional.pad(logits, (0, BLOCK - vocab % BLOCK), value=float("-inf"))
    blocks = logits.view(rows, -1, BLOCK)
    best_blocks = blocks.amax(-1).topk(k, dim=-1).indices
    inside = blocks.gather(1, best_blocks.unsqueeze(-1).expand(rows, k, BLOCK)).view(rows, k * BLOCK)
    within = inside.topk(k, dim=-1).indices
    return best_blocks.gather(1, within // BLOCK) * BLOCK + within % BLOCK


class Int8Head:
    def __init__(self, weight: torch.Tensor, input_absmax: torch.Tensor | None, alpha: float) -> None:
        self.weight = weight
        self.int8 = Int8Linear(weight, None, input_absmax, alpha=alpha)
        self.nbytes = self.int8.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        logits = self.int8(rows)
        candidates = top_candidates(logits, CANDIDATES)
        exact = torch.einsum("md,mkd->mk", rows.to(self.weight.dtype), self.weight[candidates])
        return logits.scatter_(-1, candidates, exact.to(logits.dtype)).view(*x.shape[:-1], -1)

    def numel(self) -> int:
        return self.int8.numel()
