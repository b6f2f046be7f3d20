"""`tokenmill bench engine --workloads structured`: what structured output costs the engine.

Three runs of the same batch on one engine (the `make up` model, which has a tokenizer): no request
constrained, half of them constrained (each by one of a set of realistic JSON schemas), all of them
constrained. Every step decodes the whole batch, so a constraint's price is what it adds to every
step: the time of a decode step of the whole batch (the first k of them in every run, before any
answer ends: constrained answers end sooner, which would flatter their TPOT), TPOT p50/p99 and output tok/s of each run, and the ratios to
the unconstrained run. Also the
grammar compile time per schema, first (uncached) and repeated (cached).
"""
from __future__ import annotations

import random
import statistics
import time

from tokenmill.progress import bar
from tokenmill.benchmarks.harness.report import percentile, sample_percentile

_S = {"type": "string"}
SCHEMAS = {
    "contact": {"type": "object", "additionalProperties": False, "required": ["name", "email", "role", "age"],
                "properties": {"name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "maxLength": 60},
                               "role": {"enum": ["admin", "editor", "viewer"]},
                               "age": {"type": "integer", "minimum": 0, "maximum": 150}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["id", "status", "items", "address"],
              "properties": {
                  "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
                  "status": {"enum": ["open", "paid", "shipped", "cancelled"]},
                  "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": {
                      "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                      "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1},
                                     "price": {"type": "number"}}}},
                  "address": {"type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
                              "properties": {"street": _S, "city": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "event": {"type": "object", "additionalProperties": False, "required": ["title", "start", "attendees", "tags"],
              "properties": {"title": {"type": "string", "minLength": 3, "maxLength": 80},
                             "start": {"type": "string", "format": "date-time"},
                             "attendees": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 30},
                             "tags": {"type": "array", "items": {"enum": ["work", "home", "travel", "health"]}},
                             "online": {"type": "boolean"}}},
    "extraction": {"type": "object", "additionalProperties": False, "required": ["entities", "summary"],
                   "properties": {"summary": {"type": "string", "maxLength": 200},
                                  "entities": {"type": "array", "maxItems": 25, "items": {
                                      "type": "object", "additionalProperties": False, "required": ["text", "kind"],
                                      "properties": {"text": {"type": "string", "maxLength": 40},
                                                     "kind": {"enum": ["person", "org", "place", "date"]},
                                                     "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}}}},
    "tool_arguments": {"type": "object", "additionalProperties": False, "required": ["query", "filters"],
                       "properties": {"query": {"type": "string", "maxLength": 100},
                                      "filters": {"anyOf": [
                                          {"type": "object", "properties": {"after": {"type": "string", "format": "date"}},
                                           "required": ["after"], "additionalProperties": False},
                                          {"type": "null"}]},
                                      "limit": {"type": "integer", "minimum": 1, "maximum": 50}}},
}


def _spec(name: str) -> dict:
    return {"type": "json_schema", "schema": SCHEMAS[name], "strict": True}


def compile_times(grammars, repeats: int) -> dict:
    first, cached = [], []
    for _ in range(repeats):
        for name in SCHEMAS:
            t = time.perf_counter()
            grammars.compile_uncached(_spec(name))  # bypasses the cache: a schema seen for the first time
            first.append(time.perf_counter() - t)
    for name in SCHEMAS:
        grammars.compile(_spec(name))
    for _ in range(repeats):
        for name in SCHEMAS:
            t = time.perf_counter()
            grammars.compile(_spec(name))
            cached.append(time.perf_counter() - t)

    def ms(xs: list[float], q: float) -> float:
        return sample_percentile(xs, q) * 1000

    return {"schemas": len(SCHEMAS), "compile_p50_ms": ms(first, 50), "compile_p99_ms": ms(first, 99),
            "cached_p50_ms": ms(cached, 50), "cached_p99_ms": ms(cached, 99)}


def decode_run(engine, grammars, prompts: list[list[int]], constrained_share: float, max_tokens: int,
               label: str) -> dict:
    from gpu_consumers.engine import SamplingParams

    names = list(SCHEMAS)
    n_constrained = round(len(prompts) * constrained_share)
    kinds = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)
        if i < n_constrained:
            params.constraint = grammars.factory(grammars.compile(_spec(names[i % len(names)])))
        kinds[str(i)] = "constrained" if i < n_constrained else "free"
        engine.add_request(str(i), prompt, params)
    times: dict[str, list[float]] = {rid: [] for rid in kinds}
    stops = 0
    full_steps: list[float] = []  # decode steps of the whole batch: no request has ended yet
    t0 = last = time.perf_counter()
    ended = False
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        decoded = sum(1 for out in outs if out.new_token_ids)
        if not ended and decoded == len(prompts) and all(times[rid] for rid in times):
            full_steps.append(now - last)
        last = now
        for out in outs:
            if out.new_token_ids:
                times[out.request_id].append(now)
            if out.finished:
                ended = True
                stops += out.finish_reason == "stop"
    wall = time.perf_counter() - t0
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values() if len(ts) > 1]
    tokens = sum(len(ts) for ts in times.values())
    return {"run": label, "requests": len(prompts), "constrained": n_constrained,
            "ended_by_grammar": stops, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "tpot_p50_ms": sample_percentile(tpot, 50) * 1000,
            "tpot_p99_ms": sample_percentile(tpot, 99) * 1000,
            "full_batch_step_times": full_steps}


def run(model_dir: str, batch: int, max_tokens: int, repeats: int, rounds: int = 2,
        threads: int | None = None) -> dict:
    import torch
    from transformers import AutoTokenizer

    from gpu_consumers.engine import Engine
    from structured_outputs.grammars import compiler_for_checkpoint

    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    grammars = compiler_for_checkpoint(model_dir, tokenizer)
    compile_stats = compile_times(grammars, repeats)
    rng = random.Random(0)
    vocab = len(tokenizer)
    prompts = [[rng.randrange(10, vocab) for _ in range(64)] for _ in range(batch)]
    order = ((0.0, "unconstrained"), (0.5, "half constrained"), (1.0, "all constrained"))
    # forwards, then backwards: a machine that slows down (or warms up) during the run favours no one
    plan = [run for r in range(rounds) for run in (order if r % 2 == 0 else order[::-1])]
    done: dict[str, list[dict]] = {label: [] for _, label in order}
    steps = bar(total=len(plan), desc="structured runs", unit="run")
    for share, label in plan:
        engine = Engine.from_pretrained(model_dir, kv_cache_memory=256 * 2**20, max_num_seqs=max(batch, 1))
        done[label].append(decode_run(engine, grammars, prompts, share, max_tokens, label))
        steps.update()
    steps.close()
    # the same first k decode steps of every run: later steps attend over longer contexts
    k = min(len(r["full_batch_step_times"]) for rs in done.values() for r in rs)
    runs = []
    for _, label in order:
        rounds_of = done[label]
        merged = {key: v for key, v in rounds_of[0].items() if key != "full_batch_step_times"}
        for key in ("output_tokens_per_s", "tpot_p50_ms", "tpot_p99_ms"):
            merged[key] = statistics.median(r[key] for r in rounds_of)
        steps_ms = [t * 1000 for r in rounds_of for t in r["full_batch_step_times"][:k]]
        merged.update(rounds=len(rounds_of), full_batch_steps=len(steps_ms),
                      full_batch_step_p50_ms=percentile(steps_ms, 50), full_batch_step_p99_ms=percentile(steps_ms, 99))
        runs.append(merged)
    base = runs[0]
    for r in runs:
        r["tpot_p50_ratio"] = r["tpot_p50_ms"] / base["tpot_p50_ms"]
        r["tpot_p99_ratio"] = r["tpot_p99_ms"] / base["tpot_p99_ms"]
        r["throughput_ratio"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        r["full_batch_step_p50_ratio"] = r["full_batch_step_p50_ms"] / base["full_batch_step_p50_ms"]
        r["full_batch_step_p99_ratio"] = r["full_batch_step_p99_ms"] / base["full_batch_step_p99_ms"]
    return {"model": model_dir, "batch": batch, "max_tokens": max_tokens, "compile": compile_stats, "runs": runs}


def format_report(result: dict) -> str:
    c = result["compile"]
    lines = [f"structured output, {result['batch']} requests x {result['max_tokens']} tokens, model {result['model']}",
             f"grammar compile ({c['schemas']} schemas): first p50 {c['compile_p50_ms']:.2f} ms, "
             f"p99 {c['compile_p99_ms']:.2f} ms; cached p50 {c['cached_p50_ms']:.3f} ms, p99 {c['cached_p99_ms']:.3f} ms",
             f"{'run':<18}{'constrained':>12}{'ended':>7}{'tok/s':>9}{'TPOT p50':>10}{'TPOT p99':>10}"
             f"{'full step p50':>15}{'p99':>9}{'p50 x':>7}{'p99 x':>7}"]
    for r in result["runs"]:
        lines.append(f"{r['run']:<18}{r['constrained']:>12}{r['ended_by_grammar']:>7}{r['output_tokens_per_s']:>9.1f}"
                     f"{r['tpot_p50_ms']:>8.1f}ms{r['tpot_p99_ms']:>8.1f}ms{r['full_batch_step_p50_ms']:>13.1f}ms"
                     f"{r['full_batch_step_p99_ms']:>7.1f}ms{r['full_batch_step_p50_ratio']:>7.2f}"
                     f"{r['full_batch_step_p99_ratio']:>7.2f}")
    lines.append("ended: answers the grammar finished before max_tokens (their batch then shrinks, so TPOT "
                 "flatters the constrained runs); full step: a decode step of the whole batch, the like-for-like "
                 "price of the constraint; x = that step against the unconstrained run's")
    return "\n".join(lines)
