"""Public API: Engine, RequestOutput, GenerateResult."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from ..lora.manager import LoraManager
from ..lora.request import LoraRequest
from formats.adapter_files import BaseShapes
from ..model.llama import LlamaForCausalLM
from ..model.model_runner import ModelRunner
from ..quantization.calibration import calibration_text
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache_manager import KVCacheManager, adapter_cache_salt
from .outputs import Choice, GenerateResult, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import LORA_LOAD_FAILED, Sequence, SequenceStatus

# How long a step with nothing to run (every queued sequence waits for its adapter) blocks on a read.
LORA_IDLE_WAIT_S = 0.005


class Engine:
    def __init__(self, model: LlamaForCausalLM, tokenizer=None, config: EngineConfig | None = None,
                 **options) -> None:
        """`options` are EngineConfig fields, overriding `config`'s. The settings of the model itself
        (device, dtype, quantization, kv_cache_dtype, use_onednn, native_layer_ops, compile_decode) are
        the ones it was loaded with: `config` may not name others."""
        config = replace(config or model.config, **options)
        if config.model_settings() != model.config.model_settings():
            raise ValueError(f"the model was loaded as {model.config.model_settings()}, not "
                             f"{config.model_settings()}: load it with these settings (Engine.from_pretrained)")
        self.config = config
        max_num_seqs, max_num_batched_tokens = config.batch_limits()
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size = config.block_size
        self.max_model_len = min(config.max_model_len or model.cfg.max_position_embeddings,
                                 model.cfg.max_position_embeddings)
        num_kv_blocks = config.num_kv_blocks
        if num_kv_blocks is None:
            if config.kv_cache_memory is None:
                raise ValueError("pass kv_cache_memory or num_kv_blocks")
            num_kv_blocks = int(config.kv_cache_memory // model.kv_bytes_per_block(block_size))
        num_kv_blocks += 1  # block 0 is the reserved null block
        if num_kv_blocks < 2:
            raise ValueError("KV cache too small for a single block")
        self.kv = KVCacheManager(num_kv_blocks, block_size, config.enable_prefix_caching)
        # LoRA adapters: stacked slot weights are allocated when the first adapter is installed
        self.lora = LoraManager(BaseShapes.from_model_config(model.cfg), config.max_loras, config.max_lora_rank,
                                model.dtype, model.device)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, ready=self._adapter_ready)
        self.runner = ModelRunner(model, num_kv_blocks, block_size, self.lora)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = config.enable_prefix_caching
        self.eos_token_ids = set(model.cfg.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}
        self.num_steps = 0
        # optional per-step trace for benchmarks: (num_decodes, num_tokens, step_s, forward_s)
        self.step_trace: list | None = None

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig | None = None, tokenizer=None,
                        **options) -> "Engine":
        """An engine for the Hugging Face checkpoint directory at `path` (weights, tokenizer and
        generation_config.json) as `config` says, `options` (EngineConfig fields: device, dtype,
        quantization, kv_cache_dtype, ...) overriding it; `tokenizer`: the checkpoint's, already loaded
        (else AutoTokenizer loads it)."""
        config = replace(config or EngineConfig(), **options)
        if tokenizer is None and any(os.path.exists(os.path.join(path, f))
                                     for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
        calibration_ids = None
        if config.quantization is not None and tokenizer is not None:
            calibration_ids = tokenizer.encode(calibration_text())
        model = LlamaForCausalLM.from_pretrained(path, config, calibration_ids)
        gen_cfg = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_cfg):
            import json

            with open(gen_cfg) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                model.cfg.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        return cls(model, tokenizer, config)

    def warmup(self) -> float:
        """Waits until the compiled decode kernel's graphs are built (they build in the background from
        the engine's start; until then decode runs the eager path) and runs tiny requests through
        every kind of step; returns the seconds it took (paid once per process). Leaves the prefix
        cache empty."""
        t0 = time.perf_counter()
        self.model.attention.decode.wait()
        vocab = self.model.cfg.vocab_size
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        # decode batches of one and of two sequences, over one block and over two
        for short in (False, True):
            n = 2 if short else self.block_size + 3
            self.generate([[1 % vocab] * n], params)
            self.generate([[2 % vocab] * n, [3 % vocab] * (n - 1)], params)
        self.kv.pool.reset_prefix_cache()
        return time.perf_counter() - t0

    # ------------------------------------------------------------ requests
    @property
    def num_total_blocks(self) -> int:
        return self.kv.pool.num_usable_blocks

    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks()

    @property
    def prefix_cache_version(self) -> int:
        """Changes whenever a block enters or leaves the prefix cache."""
        return self.kv.pool.cache_version

    def cached_block_hashes(self, limit: int) -> list[bytes]:
        """Hashes (formats/prefix_hash.py) of up to `limit` blocks in the prefix cache, newest last."""
        return self.kv.cached_hashes(limit) if self.kv.enable_prefix_caching else []

    def num_free_slots(self) -> int:
        return self.max_num_seqs - len(self.scheduler.running) - len(self.scheduler.waiting)

    def can_admit(self, prompt_len: int) -> bool:
        if self.num_free_slots() <= 0 or prompt_len >= self.max_model_len:
            return False
        reserved = sum(self.kv.num_blocks_for(s.num_tokens - s.num_computed_tokens + 1)
                       for s in self.scheduler.waiting)
        return self.kv.num_blocks_for(prompt_len + 1) <= self.num_free_blocks() - reserved

    def resident_adapters(self) -> list[str]:
        """Ids of the LoRA adapters loaded in a slot now, least recently used first."""
        return self.lora.resident_ids()

    def _adapter_ready(self, seq: Sequence) -> bool:
        return seq.adapter_id is None or self.lora.is_resident(seq.adapter_id)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, resume_token_ids: list[int] | None = None,
                    resume_text_chars: int = 0, lora: LoraRequest | None = None) -> None:
        """Queue a request. ``resume_token_ids`` continues one that was preempted elsewhere after
        producing those tokens (of which ``resume_text_chars`` characters were already sent): its
        output goes on exactly as if it had never stopped.

        ``lora`` runs it with that LoRA adapter (docs/lora.md). An adapter directory that fails
        validation raises LoraLoadError (a ValueError) here and nothing is queued; one that is valid
        but not resident is read in the background while the request waits in the queue, and if
        that read fails the request ends with finish_reason LORA_LOAD_FAILED and RequestOutput.error."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"duplicate request_id {request_id!r}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len={self.max_model_len}")
        if self.kv.num_blocks_for(len(prompt) + 1) > self.num_total_blocks:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the KV cache")
        vocab = self.model.cfg.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError("prompt token id out of range")
        resumed = list(resume_token_ids or [])
        if resumed:
            if params.n != 1:
                raise ValueError("only a single-choice request can be resumed")
            if len(resumed) >= params.max_tokens or len(prompt) + len(resumed) >= self.max_model_len:
                raise ValueError("nothing is left to generate for the resumed request")
            if min(resumed) < 0 or max(resumed) >= vocab:
                raise ValueError("resumed token id out of range")
        adapter_id = None
        if lora is not None:
            if not isinstance(lora, LoraRequest) or not lora.adapter_id:
                raise ValueError("lora must be a LoraRequest with an adapter_id")
            self.lora.request(lora)  # raises LoraLoadError for a directory that cannot be served
            adapter_id = lora.adapter_id
            cache_salt = adapter_cache_salt(cache_salt, adapter_id)
        now = time.monotonic()
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(request_id, i, prompt, params, cache_salt, now,
                           parent=seqs[0] if i > 0 else None, adapter_id=adapter_id)
            if self.tokenizer is not None:
                seq.detok = IncrementalDetokenizer(self.tokenizer, prompt, params.stop)
            if resumed:
                self._replay(seq, resumed, resume_text_chars)
            seqs.append(seq)
        self.requests[request_id] = seqs
        for s in seqs:
            self.scheduler.add(s)

    def _replay(self, seq: Sequence, token_ids: list[int], text_chars: int) -> None:
        """Put a sequence where it stood after generating ``token_ids``: the tokens become part of what
        is recomputed at prefill (the prefix cache often holds them), the seeded generator is advanced
        by the draws they took, and the detokenizer knows which text the client already has."""
        for tok in token_ids:
            seq.append_token(tok)
            if seq.constraint is not None and not seq.constraint.accept(tok):
                raise ValueError("the resumed tokens do not match the request's response_format")
        if seq.generator is not None and seq.params.temperature != 0.0:
            vocab = self.model.cfg.vocab_size
            for _ in token_ids:  # one row of noise per sampled token, exactly as the sampler draws it
                torch.empty(vocab, dtype=torch.float32).exponential_(generator=seq.generator)
        if seq.detok is not None:
            seq.detok.add_tokens(token_ids)
            seq.detok.emitted = min(text_chars, len(seq.detok.text))

    def output_token_ids(self, request_id: str) -> list[int] | None:
        """What a single-choice request has generated so far (None if unknown)."""
        seqs = self.requests.get(request_id)
        return list(seqs[0].output_token_ids) if seqs and len(seqs) == 1 else None

    def abort(self, request_id: str) -> None:
        seqs = self.requests.pop(request_id, None)
        if not seqs:
            return
        for s in seqs:
            if s.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(s, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def stats(self) -> dict:
        kv = self.kv
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": kv.usage(),
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "lora_resident": len(self.lora.resident),
            "lora_loads": self.lora.num_loads,
            "lora_evictions": self.lora.num_evictions,
            "lora_load_failures": self.lora.num_load_failures,
            "lora_share_preemptions": self.lora.num_share_preemptions,
        }

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule a batch, run it, return what it produced."""
        failed = self._poll_adapters() if self.lora.in_use else []
        sched = self.scheduler.schedule()
        if not sched and self.lora.loading:
            self.lora.wait(LORA_IDLE_WAIT_S)  # nothing can run until an adapter is read
        return self.run_scheduled(sched, failed)

    def _poll_adapters(self) -> list[RequestOutput]:
        """Between steps: install adapters that finished reading; end the requests whose adapter failed."""
        failed, preempt = self._poll_adapters_once()
        if preempt is not None:  # one owner holds more than its share of the slots while another waits
            self.scheduler.preempt_where(lambda seq: seq.adapter_id == preempt)
            more_failed, _ = self._poll_adapters_once()  # the freed slot goes to the waiting owner now
            failed.update(more_failed)
        waiting = self.scheduler.waiting
        outputs = []
        if failed:
            for seq in [s for s in waiting if s.adapter_id in failed]:
                self.scheduler.finish(seq, LORA_LOAD_FAILED)
                out = self._make_output(seq, [], None, True)
                assert seq.adapter_id is not None
                out.error = failed[seq.adapter_id]
                outputs.append(out)
                self._maybe_drop_request(seq)
        return outputs

    def _poll_adapters_once(self) -> tuple[dict[str, str], str | None]:
        running, waiting = self.scheduler.running, self.scheduler.waiting
        pinned = {s.adapter_id for s in running if s.adapter_id is not None}
        wanted = pinned | {s.adapter_id for s in waiting if s.adapter_id is not None}
        return self.lora.poll(pinned, wanted)

    def run_scheduled(self, sched, outputs: list[RequestOutput] | None = None) -> list[RequestOutput]:
        """Runs a batch the scheduler has built and applies its result: `step` is `schedule` then
        this (the engine benchmark times the two apart); `outputs` are ones the step already has."""
        t0 = time.perf_counter()
        outputs = outputs if outputs is not None else []
        for seq in sched.capacity_finished:
            outputs.append(self._make_output(seq, [], None, True))
            self._maybe_drop_request(seq)
        if not sched:
            return outputs
        tokens, lps = self.runner.execute(sched)
        # The scheduler owns every state transition; the engine only reports what happened.
        updated = self.scheduler.update_from_output(sched, tokens, time.monotonic(), self.eos_token_ids,
                                                    self.max_model_len)
        for i, seq, finished in updated:
            lp = lps[i] if lps is not None else None
            outputs.append(self._make_output(seq, [tokens[i]], [lp] if seq.params.logprobs is not None else None,
                                             finished))
        for _, seq, finished in updated:
            if finished:
                self._maybe_drop_request(seq)
        self.num_steps += 1
        if self.step_trace is not None:
            self.step_trace.append((sum(1 for n in sched.num_tokens if n == 1), sched.total_tokens,
                                    time.perf_counter() - t0, self.runner.last_forward_s))
        return outputs

    def _make_output(self, seq: Sequence, new_tokens: list[int], logprobs, finished: bool) -> RequestOutput:
        text = ""
        if seq.detok is not None:
            if finished:
                seq.detok.flush()
            text = seq.detok.take_delta(finished)
        return RequestOutput(
            request_id=seq.request_id, choice_index=seq.choice_index, new_token_ids=new_tokens,
            first_token_index=seq.num_output_tokens - len(new_tokens), text_delta=text,
            logprobs=logprobs, finished=finished, finish_reason=seq.finish_reason if finished else None,
            prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens,
            # a resumed sequence also finds its earlier output in the cache; only prompt tokens count
            cached_tokens=min(seq.num_cached_tokens, seq.num_prompt_tokens), arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time, first_token_time=seq.first_token_time,
        )

    def _maybe_drop_request(self, seq: Sequence) -> None:
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and all(s.status is SequenceStatus.FINISHED for s in seqs):
            del self.requests[seq.request_id]

    # ------------------------------------------------------------ generate
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None,
                 lora: LoraRequest | list[LoraRequest | None] | None = None) -> list[GenerateResult]:
        """Blocking helper: runs the given prompts (text or token id lists) to completion; ``lora``:
        one adapter for all, or one (or None) per prompt. A prompt whose adapter failed to load ends
        with finish_reason LORA_LOAD_FAILED."""
        if params is None:
            params = SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("params list must match prompts")
        llist = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(llist) != len(prompts):
            raise ValueError("lora list must match prompts")
        results: dict[str, GenerateResult] = {}
        order = []
        for i, (prompt, p, adapter) in enumerate(zip(prompts, plist, llist)):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer")
                prompt = self.tokenizer.encode(prompt)
            rid = f"generate-{id(results)}-{i}"
            self.add_request(rid, prompt, p, cache_salt, lora=adapter)
            order.append(rid)
            results[rid] = GenerateResult(rid, list(prompt), [
                Choice(j, [], "", None, [] if p.logprobs is not None else None) for j in range(p.n)])
        pending = set(order)
        while pending:
            if not self.has_unfinished_requests():
                break
            for out in self.step():
                r = results.get(out.request_id)
                if r is None:
                    continue
                c = r.choices[out.choice_index]
                c.token_ids.extend(out.new_token_ids)
                c.text += out.text_delta
                if out.logprobs is not None and c.logprobs is not None:
                    c.logprobs.extend(out.logprobs)
                r.cached_tokens = max(r.cached_tokens, out.cached_tokens)
                if out.finished:
                    c.finish_reason = out.finish_reason
                    if all(ch.finish_reason is not None for ch in r.choices):
                        pending.discard(out.request_id)
        return [results[rid] for rid in order]
