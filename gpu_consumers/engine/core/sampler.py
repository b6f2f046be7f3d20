"""Batched token sampling.

Greedy (temperature 0), temperature, top-k, top-p, min-p, repetition / presence /
frequency penalties.  Sampling uses the exponential-race trick
(argmax(p / E), E ~ Exp(1), which draws from p); a request with a seed draws its
noise from its own torch.Generator, so it gets the same tokens whether it runs
alone or in any batch.  A constrained sequence (structured output) has the tokens
its constraint forbids masked out first.  Logprobs are those of the model's raw
distribution.
"""

from __future__ import annotations

import torch

from .sequence import Sequence
from .token_constraint import mask_logits


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list | None]:
        """logits: [B, V] for seqs (one row each). Returns (token ids, per-row logprobs
        entries or None): an entry is a dict {token_id: logprob} holding the sampled
        token and the top-`logprobs` tokens."""
        logits = logits.float()
        B = logits.shape[0]
        all_greedy = True
        any_penalty = False
        any_logprobs = False
        for s in seqs:
            p = s.params
            if p.temperature != 0.0:
                all_greedy = False
            if p.needs_penalties:
                any_penalty = True
            if p.logprobs is not None:
                any_logprobs = True

        raw_logprobs = torch.log_softmax(logits, -1) if any_logprobs else None

        constrained = [(i, s.constraint) for i, s in enumerate(seqs) if s.constraint is not None]
        if constrained:
            logits = mask_logits(logits, constrained)

        if any_penalty:
            logits = logits.clone()
            for i, s in enumerate(seqs):
                if s.params.needs_penalties:
                    self._apply_penalties(logits[i], s)

        if all_greedy:
            tokens = logits.argmax(-1)
        else:
            tokens = self._sample(logits, seqs)
        token_list = tokens.tolist()

        lp_out: list[dict[int, float] | None] | None = None
        if any_logprobs:
            assert raw_logprobs is not None  # computed above whenever a sequence asks for logprobs
            lp_out = [None] * B
            for i, s in enumerate(seqs):
                k = s.params.logprobs
                if k is None:
                    continue
                t = token_list[i]
                entry = {t: float(raw_logprobs[i, t])}
                if k > 0:
                    vals, ids = raw_logprobs[i].topk(k)
                    for tid, v in zip(ids.tolist(), vals.tolist()):
                        entry.setdefault(tid, v)
                lp_out[i] = entry
        return token_list, lp_out

    @staticmethod
    def _apply_penalties(row: torch.Tensor, s: Sequence) -> None:
        p = s.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(s.token_ids)), dtype=torch.long)
            vals = row[ids]
            row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and s.output_counts:
            ids = torch.tensor(list(s.output_counts.keys()), dtype=torch.long)
            cnt = torch.tensor(list(s.output_counts.values()), dtype=row.dtype)
            row[ids] -= p.frequency_penalty * cnt + p.presence_penalty

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        B, V = logits.shape
        greedy_tokens = logits.argmax(-1)
        samp = [i for i, s in enumerate(seqs) if s.params.temperature != 0.0]
        idx = torch.tensor(samp, dtype=torch.long)
        lg = logits.index_select(0, idx)
        ps = [seqs[i].params for i in samp]
        temps = torch.tensor([p.temperature for p in ps], dtype=lg.dtype)
        lg = lg / temps.unsqueeze(1)

        need_sort = any(p.top_k > 0 or p.top_p < 1.0 for p in ps)
        if need_sort:
            sorted_lg, sorted_idx = lg.sort(-1, descending=True)
            remove = torch.zeros_like(sorted_lg, dtype=torch.bool)
            ks = torch.tensor([p.top_k if p.top_k > 0 else V for p in ps])
            remove |= torch.arange(V).unsqueeze(0) >= ks.unsqueeze(1)
            if any(p.top_p < 1.0 for p in ps):
                top_p = torch.tensor([p.top_p for p in ps], dtype=lg.dtype)
                probs_sorted = sorted_lg.masked_fill(remove, float("-inf")).softmax(-1)
                cum = probs_sorted.cumsum(-1)
                # drop a token when the mass before it already reaches top_p
                remove |= (cum - probs_sorted) >= top_p.unsqueeze(1)
            remove[:, 0] = False
            sorted_lg = sorted_lg.masked_fill(remove, float("-inf"))
            lg = torch.full_like(lg, float("-inf")).scatter_(1, sorted_idx, sorted_lg)

        probs = lg.softmax(-1)
        if any(p.min_p > 0.0 for p in ps):
            min_p = torch.tensor([p.min_p for p in ps], dtype=probs.dtype)
            thresh = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < thresh, 0.0)

        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(samp) if seqs[i].generator is None]
        if unseeded:
            if len(unseeded) == len(samp):
                noise.exponential_()
            else:
                noise[unseeded] = torch.empty(len(unseeded), V, dtype=probs.dtype).exponential_()
        for j, i in enumerate(samp):
            g = seqs[i].generator
            if g is not None:
                noise[j] = torch.empty(V, dtype=probs.dtype).exponential_(generator=g)
        noise.clamp_(min=1e-20)
        sampled = (probs / noise).argmax(-1)
        return greedy_tokens.index_copy(0, idx, sampled)
