"""Iteration-level scheduler.

Every step builds one batch under a token budget (max_num_batched_tokens) and a
sequence budget (max_num_seqs):
  1. running sequences first, oldest first (decodes take 1 token; a sequence
     whose prompt is being prefilled in chunks takes what is left of the budget);
  2. then waiting sequences, FCFS, with their prefix-cache hits skipped and long
     prompts cut into chunks that fit the remaining budget; a sequence that is not
     ready (its LoRA adapter is still loading) is passed over, not waited for.
When a running sequence needs a block and none is free, the NEWEST running
sequence is preempted: its blocks are freed and it goes back to the front of the
waiting queue to be recomputed later (prefix caching often makes that cheap).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .sequence import CONSTRAINT_VIOLATED, KV_CACHE_FULL, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    # (src_block, dst_block, num_slots) KV copies to do before the forward (n>1 forks)
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)
    # sequences that could not be scheduled at all and were finished for capacity
    capacity_finished: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 ready: Callable[[Sequence], bool] | None = None) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # whether a waiting sequence can start (the engine: its adapter is resident)
        self.ready = ready

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # hashes of full blocks that this step's prefills will compute
        pending: set[bytes] = set()
        budget, preempted_any = self._schedule_running(out, pending)
        if not preempted_any:  # a preemption means the pool is full: nothing new starts this step
            self._schedule_waiting(out, budget, pending)
        return out

    def _schedule_running(self, out: SchedulerOutput, pending: set[bytes]) -> tuple[int, bool]:
        """Running sequences, oldest first, each its decode token or the next chunk of its prompt;
        the newest is preempted while one does not fit. Returns the budget left and whether any was."""
        budget = self.max_num_batched_tokens
        kv, running = self.kv, self.running
        preempted_any = False
        idx = 0
        while idx < len(running) and budget > 0:
            seq = running[idx]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                idx += 1
                continue
            ok = True
            while not kv.allocate_slots(seq, n):
                victim = running.pop()
                self._preempt(victim)
                preempted_any = True
                if victim is seq:
                    ok = False
                    if not running and not out.seqs:
                        # alone and still does not fit: the pool is too small for it
                        self._finish_capacity(victim, out)
                    break
            if not ok:
                break
            out.seqs.append(seq)
            out.num_tokens.append(n)
            budget -= n
            idx += 1
            if n > 1:
                self._note_pending(seq, n, pending)
        return budget, preempted_any

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, pending: set[bytes]) -> None:
        """Waiting sequences, FCFS, while budget and sequence slots last; one not ready (its adapter
        is loading) is passed over and keeps its place."""
        waiting, running, ready = self.waiting, self.running, self.ready
        now = time.monotonic()
        at = 0  # waiting[:at] are not ready and stay queued, in order
        while at < len(waiting) and budget > 0 and len(running) < self.max_num_seqs:
            seq = waiting[at]
            if ready is not None and not ready(seq):
                at += 1
                continue
            n = self._start(seq, budget, pending, out)
            if n is None:
                break
            del waiting[at]
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            running.append(seq)
            out.seqs.append(seq)
            out.num_tokens.append(n)
            budget -= n
            if n > 1:
                self._note_pending(seq, n, pending)

    def _start(self, seq: Sequence, budget: int, pending: set[bytes], out: SchedulerOutput) -> int | None:
        """The tokens a waiting `seq` starts with this step, its blocks allocated (a fork shares its
        parent's), or None when it cannot start now, and so, FCFS, nothing behind it either."""
        parent = seq.parent
        if parent is not None:
            if parent.status is SequenceStatus.RUNNING and parent.block_table:
                return self._start_fork(seq, parent, out)
            if parent.status is SequenceStatus.WAITING:
                return None  # parent was preempted; it is ahead in the queue
            seq.parent = None  # parent finished: prefill normally
        kv = self.kv
        computed = kv.get_computed_blocks(seq) if seq.num_computed_tokens == 0 else []
        nb = len(computed)
        if pending and nb < len(seq.block_hashes) and seq.block_hashes[nb] in pending:
            # its next block is being computed right now by another prefill:
            # wait one step and take it from the prefix cache instead of recomputing
            return None
        n = min(seq.num_tokens - seq.num_computed_tokens - nb * kv.block_size, budget)
        if not kv.allocate_slots(seq, n, computed):
            return None
        if not seq.prefix_looked_up:
            seq.prefix_looked_up = True
            seq.num_cached_tokens = nb * kv.block_size
            kv.record_lookup(seq.num_prompt_tokens, seq.num_cached_tokens)
        return n

    def _start_fork(self, seq: Sequence, parent: Sequence, out: SchedulerOutput) -> int | None:
        """A choice of an n > 1 request starts on its parent's prompt blocks, decoding at once."""
        kv = self.kv
        if parent.num_computed_tokens < seq.num_tokens - 1:
            return None  # parent still prefilling the shared prompt; wait for it
        if not kv.can_fork(seq, parent):
            return None
        copy = kv.fork(seq, parent)
        if copy is not None:
            out.kv_copies.append(copy)
        seq.num_cached_tokens = parent.num_cached_tokens
        seq.prefix_looked_up = True
        seq.parent = None
        return 1

    def _note_pending(self, seq: Sequence, n: int, pending: set) -> None:
        kv = self.kv
        if not kv.enable_prefix_caching:
            return
        bs = kv.block_size
        start, end = seq.num_computed_tokens // bs, (seq.num_computed_tokens + n) // bs
        if end > start:
            pending.update(kv.block_hashes_for(seq, start, end))

    def preempt_where(self, which) -> int:
        """Preempt every running sequence ``which(seq)`` is true of (back to the front of the queue, its
        blocks freed; it resumes by recompute). Returns how many."""
        chosen = [seq for seq in self.running if which(seq)]
        for seq in reversed(chosen):  # appendleft: the first chosen ends up first in the queue
            self.running.remove(seq)
            self._preempt(seq)
        return len(chosen)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.parent = None
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish_capacity(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        # Not "length": max_tokens did not end it, the whole KV cache could not hold it.
        seq.finish_reason = KV_CACHE_FULL
        out.capacity_finished.append(seq)

    # ---------------------------------------------------------------- update
    def update_from_output(self, sched: SchedulerOutput, tokens: list[int | None], now: float,
                           eos_token_ids: set[int], max_model_len: int) -> list[tuple[int, Sequence, bool]]:
        """Apply one executed step: every scheduled sequence advances by the tokens it computed,
        one that sampled a token appends it, and one that is done finishes (its blocks are freed
        at once). Returns (index in the batch, sequence, finished) for each sequence that got a token."""
        updated = []
        for i, seq in enumerate(sched.seqs):
            seq.num_computed_tokens += sched.num_tokens[i]
            self.kv.cache_full_blocks(seq)
            tok = tokens[i]
            if tok is None:
                continue  # still prefilling its prompt
            seq.append_token(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = _stop_reason(seq, tok, eos_token_ids, max_model_len)
            if reason is not None:
                self.finish(seq, reason)
            updated.append((i, seq, reason is not None))
        return updated

    # ---------------------------------------------------------------- finish
    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (running or waiting) and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _stop_reason(seq: Sequence, tok: int, eos_token_ids: set[int], max_model_len: int) -> str | None:
    """Why the sequence ends with this token, or None: "stop" for EOS (unless ignored), a stop
    token or a stop string; "length" for max_tokens or the context limit."""
    p = seq.params
    is_eos = tok in eos_token_ids and not p.ignore_eos
    reason = "stop" if is_eos or tok in p.stop_token_ids else None
    if seq.constraint is not None and not is_eos:
        if not seq.constraint.accept(tok):
            return CONSTRAINT_VIOLATED
        if seq.constraint.is_complete():  # the structured text is whole; only its end could follow
            reason = "stop"
    if seq.detok is not None and not is_eos:
        seq.detok.add_tokens([tok])
        if seq.detok.stopped:
            reason = "stop"
    if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len):
        reason = "length"
    return reason
