"""What attention needs to know about one packed batch (built by the model runner each step)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class PrefillChunk(NamedTuple):
    """One sequence's prefill chunk in the flat batch: rows [start, end), attending over ctx_len
    tokens of context."""
    start: int
    end: int
    ctx_len: int
    # None (with mask None): no earlier context, attend causally over the chunk's own K/V
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one packed batch.

    Decode tokens come first in the flat batch (rows [0, num_decodes)), followed by
    prefill chunks."""

    slot_mapping: torch.Tensor  # [T] flat slot index (block * block_size + offset)
    num_decodes: int
    # decodes: padded block tables and key mask (None when all contexts are equal)
    decode_block_tables: torch.Tensor | None  # [D, max_blocks]
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool
    decode_max_len: int
    prefills: list[PrefillChunk]
    # decodes' context lengths [D]: set where the decode backend reads the cache in place (a paged
    # kernel), None where it gathers each sequence's blocks for SDPA
    decode_lens: torch.Tensor | None = None
