"""What the engine asks of a constraint on the tokens a sequence may produce.

A constraint (a JSON schema, a grammar) lives outside the engine, which knows nothing of grammars:
it only needs, before each sampled token, the set of tokens allowed next as a packed bitmask (bit
``t % 32`` of int32 word ``t // 32`` set when token ``t`` is allowed, the layout xgrammar and
llguidance both fill), and after it, to tell the constraint which token was taken. A request
carries a factory, so every choice of an n > 1 request gets a state of its own.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch


class TokenConstraint(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, ceil(vocab / 32) words)."""

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled (or replayed) token; False if the token was not allowed."""

    def is_complete(self) -> bool:
        """The constrained text is finished: nothing may follow but the end of the sequence."""


ConstraintFactory = Callable[[], TokenConstraint]

_BIT = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def mask_logits(logits: torch.Tensor, constrained: list[tuple[int, TokenConstraint]]) -> torch.Tensor:
    """``logits`` [B, V] with every token a row's constraint forbids set to -inf, in one masked fill
    for the whole batch. Rows without a constraint are left as they are."""
    B, V = logits.shape
    bitmask = torch.full((B, bitmask_words(V)), -1, dtype=torch.int32)  # all bits set: all allowed
    for row, constraint in constrained:
        constraint.fill_bitmask(bitmask, row)
    allowed = ((bitmask.unsqueeze(-1) >> _BIT) & 1).bool().view(B, -1)[:, :V]
    return logits.masked_fill(~allowed, float("-inf"))
