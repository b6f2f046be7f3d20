"""Benchmark: what lower-precision weights cost in output quality, against float32 on the same model
(docs/benchmarks.md, "int8 projections"; issue 35's target: greedy agreement >= 95%).

    tokenmill bench quality [--model DIR] [--quantizations int8] [--dtypes bfloat16] [--prompts 32]
                            [--tokens 64] [--text FILE] [--json PATH]

agreement   float32 generates `--tokens` greedy tokens for each of `--prompts` chat prompts; the
            quantized model reads the same sequences (teacher-forced) and its argmax is compared with
            float32's token at every position: the share that agree. Teacher forcing counts each
            position's disagreement once; free-running, one early flip changes the whole tail.
prefix      free-running: the mean number of leading tokens the quantized engine's own greedy
            generation shares with float32's.
perplexity  of each model on the first 1024 tokens of `--text` (default docs/architecture.md: not the
            text int8 is calibrated on).
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from infra.paths import local_dir, REPO_ROOT
from tokenmill.benchmarks.harness.report import machine, table, write_json

TOPICS = ["the history of Rome", "how a bicycle works", "why the sky is blue", "photosynthesis",
          "a recipe for bread", "the rules of chess", "how vaccines work", "the water cycle",
          "the first computers", "how bees make honey", "volcanoes", "the moon landing"]
TEMPLATES = ["Explain {}.", "Write a short poem about {}.", "Give three facts about {}.",
             "What is the most surprising thing about {}?"]
PERPLEXITY_TOKENS = 1024


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    texts = [template.format(topic) for template in TEMPLATES for topic in TOPICS][:count]
    prompts = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


def greedy(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from gpu_consumers.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(prompts, params)]


def teacher_forced_agreement(model, prompts: list[list[int]], references: list[list[int]]) -> float:
    """The share of positions where `model`'s argmax, given the reference's own history, is the
    reference's token."""
    agree = total = 0
    for prompt, ref in zip(prompts, references):
        logits = model.sequence_logits(prompt + ref)
        predicted = logits[len(prompt) - 1:len(prompt) + len(ref) - 1].argmax(-1).tolist()
        agree += sum(p == r for p, r in zip(predicted, ref))
        total += len(ref)
    return agree / total


def identical_prefix(references: list[list[int]], outputs: list[list[int]]) -> float:
    lengths = []
    for ref, out in zip(references, outputs):
        k = 0
        while k < min(len(ref), len(out)) and ref[k] == out[k]:
            k += 1
        lengths.append(k)
    return sum(lengths) / len(lengths)


def perplexity(model, ids: list[int]) -> float:
    logits = model.sequence_logits(ids).float()
    return math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=logits.device)).item())


def main(argv=None) -> dict:
    from gpu_consumers.engine import Engine

    ap = argparse.ArgumentParser(prog="tokenmill bench quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(local_dir() / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--quantizations", default="int8", help="comma-separated (gpu_consumers.engine.QUANTIZATIONS)")
    ap.add_argument("--dtypes", default="",
                    help="comma-separated whole-model element types to measure too (bfloat16, float16): every "
                         "weight, activation and the KV cache in that type, as Engine.from_pretrained(dtype=...)")
    ap.add_argument("--kv-cache-dtypes", default="",
                    help="comma-separated KV cache element types to measure too (float16, bfloat16), with float32 "
                         "weights and with each quantization")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--text", default=str(REPO_ROOT / "docs" / "architecture.md"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    ap.add_argument("--json", default=str(local_dir() / "bench" / "quality.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    reference = Engine.from_pretrained(args.model, compile_decode=False)
    tokenizer = reference.tokenizer
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: quality is measured on chat prompts")
    prompts = chat_prompts(tokenizer, args.prompts)
    text_ids = tokenizer.encode(open(args.text, encoding="utf-8").read())[:PERPLEXITY_TOKENS]
    references = greedy(reference, prompts, args.tokens)
    # float32 against its own generation: 100% unless the one-prefill logits and the engine's steps
    # disagree, which would make every other row's number meaningless
    rows = [{"weights": "float32", "agreement": teacher_forced_agreement(reference.model, prompts, references),
             "prefix": float(args.tokens),
             "perplexity": perplexity(reference.model, text_ids), "load_s": None}]
    from gpu_consumers.engine import KV_CACHE_DTYPES

    quantizations = [q for q in args.quantizations.split(",") if q]
    kv_dtypes = [k for k in args.kv_cache_dtypes.split(",") if k]
    variants = ([(torch.float32, q, None) for q in quantizations]
                + [(torch.float32, q, k) for k in kv_dtypes for q in [None, *quantizations]]
                + [(KV_CACHE_DTYPES[d], None, None) for d in args.dtypes.split(",") if d])
    for dtype, quantization, kv in variants:
        t0 = time.perf_counter()
        engine = Engine.from_pretrained(args.model, dtype=dtype, compile_decode=False, quantization=quantization,
                                        kv_cache_dtype=KV_CACHE_DTYPES[kv] if kv else None)
        load_s = time.perf_counter() - t0
        name = quantization or str(dtype).removeprefix("torch.")
        rows.append({"weights": name + (f", KV {kv}" if kv else ""),
                     "agreement": teacher_forced_agreement(engine.model, prompts, references),
                     "prefix": identical_prefix(references, greedy(engine, prompts, args.tokens)),
                     "perplexity": perplexity(engine.model, text_ids), "load_s": load_s})
        del engine
    print(f"{args.prompts} chat prompts x {args.tokens} greedy float32 tokens; perplexity on the first "
          f"{len(text_ids)} tokens of {args.text}")
    for line in table(rows, [("weights", -20, "weights", ""), ("agreement", 10, "agreement", ".1%"),
                             ("prefix", 7, "prefix", ".1f"), ("perplexity", 11, "perplexity", ".2f"),
                             ("load s", 7, "load_s", ".1f")]):
        print(line)
    result = {"machine": machine(), "model": args.model, "prompts": args.prompts, "tokens": args.tokens,
              "text": args.text, "text_tokens": len(text_ids), "torch_threads": torch.get_num_threads(),
              "rows": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
