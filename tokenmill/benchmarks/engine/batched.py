"""The batched workload of `tokenmill bench engine`: llama-batched-bench's shape, run by tokenmill's engine
and by llama.cpp on the same checkpoint, interleaved so that every ratio comes from one run.

B sequences, each a prompt of PP random tokens and TG generated tokens (greedy, no EOS). As
llama-batched-bench counts them: PP tok/s = B*PP / time to prefill every prompt (tokenmill: until every
sequence has its first token, sampled from the prefill's logits), TG tok/s = B*TG / time of the TG decode
steps that follow. Each round runs every batch size once per system, in the order tokenmill variants then
llama.cpp peers, so the machine's load drifts over all of them alike; ratios are taken within a round and
the medians over rounds are reported.
"""
from __future__ import annotations

import os
import random
import statistics
import time

import torch

from tokenmill.benchmarks.engine import llamacpp

PROMPT = 128
GENERATED = 128


def _variant_options(name: str, dtype: torch.dtype) -> dict:
    if name == "tokenmill":
        return {"dtype": dtype}
    if name == "tokenmill-mkl":
        return {"dtype": dtype, "use_onednn": False}  # the float32 products as before oneDNN (layers/onednn.py)
    if name == "tokenmill-torch-glue":
        # the operations between the products as torch's, not the C calls (kernels/native_layer_ops.py)
        return {"dtype": dtype, "native_layer_ops": False}
    if name == "tokenmill-eager":
        return {"dtype": dtype, "compile_decode": False}
    if name == "tokenmill-bf16":
        return {"dtype": torch.bfloat16}
    if name == "tokenmill-int8":
        return {"dtype": dtype, "quantization": "int8"}
    if name == "tokenmill-kv-bf16":
        # float32 weights over a 16-bit KV cache: what llama.cpp's F32 model runs with by default (its
        # cache is F16), and what the C decode kernel reads (float16 stays on the slower compiled kernel)
        return {"dtype": dtype, "kv_cache_dtype": torch.bfloat16}
    if name == "tokenmill-int8-kv16":
        return {"dtype": dtype, "quantization": "int8", "kv_cache_dtype": torch.float16}
    raise ValueError(f"unknown engine variant {name!r}")


def make_engine(path: str, device: str, max_batch: int, options: dict):
    from gpu_consumers.engine import Engine

    engine = Engine.from_pretrained(path, device=device, enable_prefix_caching=False,
                                    kv_cache_memory=1536 * 2**20, max_num_seqs=max(max_batch, 1),
                                    max_num_batched_tokens=2048, **options)
    return engine


def run_engine(engine, batch: int, prompt: int, generated: int, seed: int) -> dict:
    from gpu_consumers.engine import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(max_tokens=generated + 1, temperature=0.0, ignore_eos=True)
    ids = [f"b{seed}-{i}" for i in range(batch)]
    t0 = time.perf_counter()
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(prompt)], params)
    seqs = [engine.requests[rid][0] for rid in ids]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    t1 = time.perf_counter()
    # sequences prefilled in an earlier step of a multi-step prefill already decoded a token or two;
    # TG counts the tokens made after the last prefill, in the steps that made them
    before = sum(s.num_output_tokens for s in seqs)
    while engine.has_unfinished_requests():
        engine.step()
    t2 = time.perf_counter()
    made = sum(s.num_output_tokens for s in seqs) - before
    return {"t_pp": t1 - t0, "speed_pp": batch * prompt / (t1 - t0), "t_tg": t2 - t1,
            "speed_tg": made / (t2 - t1)}


def run(model_dir: str, device: str, batches: list[int], rounds: int, peers: list[str], variants: list[str],
        dtype: torch.dtype = torch.float32, prompt: int = PROMPT, generated: int = GENERATED, log=print) -> dict:
    threads = torch.get_num_threads()
    out: dict = {"prompt": prompt, "generated": generated, "batches": batches, "threads": threads,
                 "rounds": [], "skipped": {}, "engine_setup_s": {}}
    ggufs = {}
    for peer in peers:
        kind = peer.removeprefix("llama.cpp-")
        try:
            llamacpp.ensure_built(log)
            ggufs[peer] = llamacpp.ensure_gguf(model_dir, kind, log)
        except llamacpp.LlamaCppUnavailable as exc:
            out["skipped"][peer] = str(exc)
            log(f"{peer} skipped: {exc}")
    engines = {}
    for v in variants:
        t0 = time.perf_counter()
        engines[v] = make_engine(model_dir, device, max(batches), _variant_options(v, dtype))
        warm = getattr(engines[v], "warmup", None)
        if warm is not None:
            warm()  # compiles the decode step (logged and timed: paid once per worker start)
        out["engine_setup_s"][v] = time.perf_counter() - t0
        log(f"{v}: engine ready in {out['engine_setup_s'][v]:.1f} s")
    for r in range(rounds):
        rows = []
        for b in batches:
            load = os.getloadavg()[0]
            for v, eng in engines.items():
                res = run_engine(eng, b, prompt, generated, seed=1000 * r + b)
                rows.append({"system": v, "batch": b, "load": load, **res})
                log(_row(rows[-1]))
            for peer, gguf in ggufs.items():
                try:
                    (res,) = llamacpp.batched_bench(gguf, [b], prompt, generated, threads)
                except llamacpp.LlamaCppUnavailable as exc:
                    out["skipped"][peer] = str(exc)
                    log(f"{peer} failed: {exc}")
                    continue
                rows.append({"system": peer, "batch": b, "load": load,
                             **{k: res[k] for k in ("t_pp", "speed_pp", "t_tg", "speed_tg")},
                             "flash_attn": res.get("flash_attn"), "n_threads": res.get("n_threads")})
                log(_row(rows[-1]))
        out["rounds"].append(rows)
    out["summary"] = summarize(out["rounds"], variants, list(ggufs))
    return out


def _row(r: dict) -> str:
    return (f"  B={r['batch']:<3} {r['system']:<18} PP {r['speed_pp']:8.1f} tok/s  TG {r['speed_tg']:8.1f} tok/s"
            f"  (load {r['load']:.1f})")


def summarize(rounds: list[list[dict]], variants: list[str], peers: list[str]) -> list[dict]:
    """Per batch size and system: median PP/TG over rounds, and the median over rounds of the
    same-round ratio to each llama.cpp peer."""
    out = []
    batches = sorted({r["batch"] for rows in rounds for r in rows})
    for b in batches:
        for s in variants + peers:
            mine = [next((r for r in rows if r["batch"] == b and r["system"] == s), None) for rows in rounds]
            if not any(mine):
                continue
            row = {"batch": b, "system": s,
                   "speed_pp": statistics.median(m["speed_pp"] for m in mine if m),
                   "speed_tg": statistics.median(m["speed_tg"] for m in mine if m),
                   "load": statistics.median(m["load"] for m in mine if m)}
            for p in peers:
                ratios_tg, ratios_pp = [], []
                for rows, m in zip(rounds, mine):
                    peer = next((r for r in rows if r["batch"] == b and r["system"] == p), None)
                    if m and peer:
                        ratios_tg.append(m["speed_tg"] / peer["speed_tg"])
                        ratios_pp.append(m["speed_pp"] / peer["speed_pp"])
                if ratios_tg and s != p:
                    row[f"tg_vs_{p}"] = statistics.median(ratios_tg)
                    row[f"pp_vs_{p}"] = statistics.median(ratios_pp)
            out.append(row)
    return out


def format_report(res: dict) -> str:
    peers = sorted({k.removeprefix("tg_vs_") for r in res["summary"] for k in r if k.startswith("tg_vs_")})
    head = ["B", "system", "PP tok/s", "TG tok/s"] + [f"TG / {p}" for p in peers] + [f"PP / {p}" for p in peers[:1]]
    lines = [f"batched: {res['prompt']} prompt + {res['generated']} generated tokens per sequence, "
             f"{len(res['rounds'])} rounds, {res['threads']} threads (medians; ratios within a round)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["summary"]:
        cells = [str(r["batch"]), r["system"], f"{r['speed_pp']:.1f}", f"{r['speed_tg']:.1f}"]
        cells += [f"{r[f'tg_vs_{p}']:.2f}x" if f"tg_vs_{p}" in r else "" for p in peers]
        cells += [f"{r[f'pp_vs_{p}']:.2f}x" if f"pp_vs_{p}" in r else "" for p in peers[:1]]
        lines.append("| " + " | ".join(cells) + " |")
    for peer, why in res["skipped"].items():
        lines.append(f"{peer} skipped: {why}")
    return "\n".join(lines)
