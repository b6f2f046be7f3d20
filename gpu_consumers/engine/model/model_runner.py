"""Turns a scheduled batch into flat tensors, runs the model, samples."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ..attention.metadata import AttentionMetadata, PrefillChunk
from ..core.sampler import Sampler
from ..core.scheduler import SchedulerOutput
from ..core.sequence import Sequence
from ..lora.manager import LoraManager
from ..lora.slots import LoraBatch
from .llama import LlamaForCausalLM


class ModelInput(NamedTuple):
    """One step's batch as the model takes it. Rows are in batch order (decodes first); `order[i]`
    is the index into the scheduled sequences of row group i, and `sample_rows[i]` the flat row
    whose logits sample that sequence's next token, or -1 while it is still prefilling."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    order: list[int]
    lora: LoraBatch | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 lora: LoraManager | None = None) -> None:
        self.model = model
        self.lora = lora
        # decode attention through a paged kernel that reads the cache in place (the C or the compiled
        # one: the model's decode backend, attention/decode_backends.py) needs the decode rows' context
        # lengths; the compiled one's graphs start building in the background now (SDPA serves until then)
        decode = model.attention.decode
        self.compile_decode = decode.reads_cache_in_place
        decode.start(block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.sampler = Sampler()
        self.device = model.device
        # timing of the last execute() (seconds): forward only vs whole call
        self.last_forward_s = 0.0
        self.last_prepare_s = 0.0

    # ------------------------------------------------------------- prepare
    def prepare(self, seqs: list[Sequence], num_tokens: list[int]) -> ModelInput:
        bs = self.block_size
        dec = [i for i, n in enumerate(num_tokens) if n == 1]
        pre = [i for i, n in enumerate(num_tokens) if n != 1]
        order = dec + pre
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        D = len(dec)
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        row = 0
        for i in dec:
            s = seqs[i]
            nc = s.num_computed_tokens
            bt = s.block_table
            ids.append(s.token_ids[nc])
            pos.append(nc)
            slots.append(bt[nc // bs] * bs + nc % bs)
            ctx = nc + 1
            ctx_lens.append(ctx)
            tables.append(bt)
            sample_rows.append(row if ctx == s.num_tokens else -1)
            row += 1
        max_len = max(ctx_lens, default=0)
        dec_bt, dec_mask, dec_lens = self._decode_tables(tables, ctx_lens, max_len) if D else (None, None, None)
        prefills = []
        slot_tensors = [torch.tensor(slots, dtype=torch.long)] if slots else []
        pos_tensors = [torch.tensor(pos, dtype=torch.long)] if pos else []
        for i in pre:
            s = seqs[i]
            n = num_tokens[i]
            nc = s.num_computed_tokens
            ctx = nc + n
            ids.extend(s.token_ids[nc:ctx])
            p = torch.arange(nc, ctx)
            nblk = -(-ctx // bs)
            blocks = torch.tensor(s.block_table[:nblk], dtype=torch.long)
            slot_tensors.append(blocks[p // bs] * bs + p % bs)
            pos_tensors.append(p)
            if nc == 0:
                prefills.append(PrefillChunk(row, row + n, ctx, None, None))
            else:
                mask = torch.arange(ctx).unsqueeze(0) <= p.unsqueeze(1)
                prefills.append(PrefillChunk(row, row + n, ctx, blocks, mask))
            row += n
            sample_rows.append(row - 1 if ctx == s.num_tokens else -1)
        input_ids = torch.tensor(ids, dtype=torch.long)
        positions = torch.cat(pos_tensors) if len(pos_tensors) > 1 else pos_tensors[0]
        slot_mapping = torch.cat(slot_tensors) if len(slot_tensors) > 1 else slot_tensors[0]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, num_decodes=D, decode_block_tables=dec_bt,
            decode_mask=dec_mask, decode_max_len=max_len, prefills=prefills, decode_lens=dec_lens,
        )
        lora = None
        if self.lora is not None:
            lora = self.lora.batch([seqs[i].adapter_id for i in order], [num_tokens[i] for i in order])
        return ModelInput(input_ids, positions, meta, sample_rows, order, lora)

    def _decode_tables(self, tables: list[list[int]], ctx_lens: list[int], max_len: int):
        """The decode rows' block tables padded to the longest context's blocks, their context lengths
        (for the paged kernels) and, when the lengths differ, the padding mask the eager path needs."""
        D, nbk = len(tables), -(-max_len // self.block_size)
        dec_bt = torch.tensor([t[:nbk] + [0] * (nbk - len(t[:nbk])) for t in tables], dtype=torch.long)
        dec_lens = torch.tensor(ctx_lens, dtype=torch.long) if self.compile_decode else None
        dec_mask = None
        if min(ctx_lens) != max_len:
            cl = torch.tensor(ctx_lens)
            dec_mask = (torch.arange(max_len).unsqueeze(0) < cl.unsqueeze(1)).view(D, 1, 1, max_len)
        return dec_bt, dec_mask, dec_lens

    # ------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[int | None], list | None]:
        """Runs one step. Returns, aligned with sched.seqs, the sampled token (None
        for a sequence that is still prefilling) and the logprobs entries."""
        t0 = time.perf_counter()
        for src, dst, n in sched.kv_copies:
            for cache in self.kv_caches:
                cache[:, dst, :n] = cache[:, src, :n]
        seqs = sched.seqs
        input_ids, positions, meta, sample_rows, order, lora = self.prepare(seqs, sched.num_tokens)
        t1 = time.perf_counter()
        hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, lora)
        rows = [r for r in sample_rows if r >= 0]
        result: list[int | None] = [None] * len(seqs)
        lps: list | None = None
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long)])
            t2 = time.perf_counter()
            sample_seqs = [seqs[order[j]] for j, r in enumerate(sample_rows) if r >= 0]
            toks, lp = self.sampler(logits, sample_seqs)
            k = 0
            sampled_lps: list = [None] * len(seqs)
            for j, r in enumerate(sample_rows):
                if r >= 0:
                    result[order[j]] = toks[k]
                    if lp is not None:
                        sampled_lps[order[j]] = lp[k]
                    k += 1
            if lp is not None:
                lps = sampled_lps
        else:
            t2 = time.perf_counter()
        self.last_prepare_s = t1 - t0
        self.last_forward_s = t2 - t1
        return result, lps

    @torch.inference_mode()
    def forward_only(self, inputs: ModelInput) -> torch.Tensor:
        """Bare model forward + logits on prepared inputs (for overhead measurement)."""
        input_ids, positions, meta, sample_rows, _, lora = inputs
        hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, lora)
        rows = [r for r in sample_rows if r >= 0]
        return self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long)])
