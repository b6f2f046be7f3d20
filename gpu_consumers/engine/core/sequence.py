"""Per-sequence request state (one Sequence per choice of a request)."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .detokenizer import IncrementalDetokenizer
    from .sampling_params import SamplingParams
    from .token_constraint import TokenConstraint


# The finish reason of a sequence the whole KV cache cannot hold (prompt plus what it generated):
# not "length", which means max_tokens or the model's context ended it.
KV_CACHE_FULL = "kv_cache_full"
# The finish reason of a sequence whose structured-output constraint refused its token (a matcher
# that failed): the worker turns it into an error for that request alone.
CONSTRAINT_VIOLATED = "constraint_violated"
# The finish reason of a sequence whose LoRA adapter could not be loaded (RequestOutput.error says why):
# it never ran.
LORA_LOAD_FAILED = "lora_load_failed"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    __slots__ = (
        "seq_id", "request_id", "choice_index", "token_ids", "num_prompt_tokens",
        "num_computed_tokens", "block_table", "block_hashes", "status", "params",
        "cache_salt", "arrival_time", "first_scheduled_time", "first_token_time",
        "num_cached_tokens", "generator", "detok", "finish_reason", "parent",
        "prefix_looked_up", "output_counts", "num_registered_blocks", "constraint", "adapter_id",
    )

    def __init__(
        self,
        request_id: str,
        choice_index: int,
        prompt_token_ids: list[int],
        params: "SamplingParams",
        cache_salt: str | None,
        arrival_time: float,
        parent: "Sequence | None" = None,
        adapter_id: str | None = None,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.choice_index = choice_index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.status = SequenceStatus.WAITING
        self.params = params
        self.cache_salt = cache_salt
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_cached_tokens = 0
        self.prefix_looked_up = False
        self.num_registered_blocks = 0  # leading full blocks already offered to the prefix cache
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed + choice_index)
        self.detok: IncrementalDetokenizer | None = None
        self.finish_reason: str | None = None
        # An n>1 sibling waits for its parent's prompt KV, then shares its blocks.
        self.parent = parent
        # token id -> count over generated tokens (for presence/frequency penalties)
        self.output_counts: dict[int, int] | None = {} if params.needs_penalties else None
        self.constraint: TokenConstraint | None = params.constraint() if params.constraint is not None else None
        # the LoRA adapter it runs with (None: the base model); part of cache_salt too (prefix caching)
        self.adapter_id = adapter_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.output_counts is not None:
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}#{self.choice_index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")
