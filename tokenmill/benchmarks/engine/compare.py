"""Benchmark: tokenmill engine vs transformers on the same model and workloads.

    python -m tokenmill.benchmarks.engine.compare [--quick] [--device cpu|cuda] [--model DIR] [--json PATH]

Systems
  transformers-sequential  model.generate, one request at a time (FCFS)
  transformers-static      model.generate on left-padded static batches
  transformers-cb          transformers continuous batching (paged|sdpa attention)
  tokenmill-prefix-off     this engine, prefix caching off
  tokenmill-prefix-on      this engine, prefix caching on
Workloads
  mixed          prompts 32-1024, outputs 16-256, all arrive at t=0
  decode-heavy   prompts 16-64, outputs 128-512, all at t=0
  shared-prefix  one 1024-token system prompt + unique 16-64-token suffixes, outputs 16-48, all at t=0
  online         Poisson arrivals; TTFT / TPOT / ITL percentiles (vllm bench serve definitions)
  concurrency-16 closed loop: 16 requests in flight at all times (prompts 64-256, outputs 64), as
                 `vllm bench serve --max-concurrency 16`; TTFT counts from each request's admission
                 (tokenmill systems only; on request, e.g. for the real model with --dtype float32/bfloat16)
  batched        llama-batched-bench's shape: B sequences x 128 prompt tokens x 128 generated, B = 1, 16, 64
                 (--batches); prefill (PP) and decode (TG) tokens/s of tokenmill and of llama.cpp at F32, Q8_0
                 and Q4_1 on the same checkpoint (the real model: --model .local/models/smollm2-135m-instruct),
                 interleaved per batch size and round (--rounds) so that every ratio is from one run; on request
All requests use ignore_eos semantics so output lengths are exactly as drawn.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from infra import settings
from infra.paths import local_dir
from tokenmill.progress import above_bars, bar
from tokenmill.benchmarks.harness.report import percentile, write_json

SYSTEMS = ["transformers-sequential", "transformers-static", "transformers-cb",
           "tokenmill-prefix-off", "tokenmill-prefix-on"]
WORKLOADS = ["mixed", "decode-heavy", "shared-prefix", "online"]  # and "structured" (structured.py), on request

# requests per workload (full, quick); transformers-sequential runs at most SEQ_CAP of them
NUM_REQUESTS = {"mixed": (64, 32), "decode-heavy": (128, 64), "shared-prefix": (64, 16), "online": (64, 16),
                "concurrency-16": (64, 32)}
CONCURRENCY = {"concurrency-16": 16}  # closed-loop workloads: how many requests are in flight at once
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SEQ_CAP = (16, 3)
ONLINE_RATE = 2.0  # requests / s
STATIC_BATCH = 16


# --------------------------------------------------------------------------- model
def build_random_model(path: str) -> str:
    """Random ~34M-parameter Llama (hidden 512, 8 layers, 8 heads / 4 kv heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------ workloads
@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0  # seconds after start


def make_workload(name: str, n: int, vocab: int, seed: int = 0) -> list[Req]:
    rng = random.Random(f"{name}-{seed}")

    def toks(k):
        return [rng.randrange(3, vocab) for _ in range(k)]

    if name == "mixed":
        return [Req(toks(rng.randint(32, 1024)), rng.randint(16, 256)) for _ in range(n)]
    if name == "decode-heavy":
        return [Req(toks(rng.randint(16, 64)), rng.randint(128, 512)) for _ in range(n)]
    if name == "shared-prefix":
        system = toks(1024)
        return [Req(system + toks(rng.randint(16, 64)), rng.randint(16, 48)) for _ in range(n)]
    if name == "online":
        t = 0.0
        out = []
        for _ in range(n):
            t += rng.expovariate(ONLINE_RATE)
            out.append(Req(toks(rng.randint(32, 512)), rng.randint(32, 128), arrival=t))
        return out
    if name in CONCURRENCY:
        return [Req(toks(rng.randint(64, 256)), 64) for _ in range(n)]
    raise ValueError(name)


# -------------------------------------------------------------------------- metrics
@dataclass
class Run:
    system: str
    workload: str
    reqs: list[Req]
    start: float = 0.0
    end: float = 0.0
    # per request: list of token timestamps (absolute, same clock as start)
    token_times: list[list[float]] = field(default_factory=list)
    # closed-loop runs: when each request was admitted (absolute); TTFT counts from there
    admitted: dict[int, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def _sent(self, i: int) -> float:
        return self.admitted.get(i, self.start + self.reqs[i].arrival)

    def result(self) -> dict:
        dur = self.end - self.start
        done = [(r, ts) for r, ts in zip(self.reqs, self.token_times) if ts]
        sent = [self._sent(i) for i, ts in enumerate(self.token_times) if ts]
        out_toks = sum(len(ts) for _, ts in done)
        in_toks = sum(len(r.prompt) for r, _ in done)
        ttft = [ts[0] - t for (_, ts), t in zip(done, sent)]
        tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for _, ts in done if len(ts) > 1]
        itl = [b - a for _, ts in done for a, b in zip(ts, ts[1:])]
        e2e = [ts[-1] - t for (_, ts), t in zip(done, sent)]
        res = {
            "system": self.system, "workload": self.workload, "num_requests": len(done),
            "duration_s": dur, "input_tokens": in_toks, "output_tokens": out_toks,
            "output_tokens_per_s": out_toks / dur if dur > 0 else None,
            "total_tokens_per_s": (in_toks + out_toks) / dur if dur > 0 else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "e2e_p50_s": percentile(e2e, 50), "prefix_hit_rate": None,
        }
        res.update(self.extra)
        return res


# --------------------------------------------------------------------- transformers
class _TokenClock:
    """LogitsProcessor that timestamps every generated position (called once per step)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def _hf_generate(model, prompts: list[list[int]], max_new: int):
    from transformers import LogitsProcessorList

    clock = _TokenClock()
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    with torch.inference_mode():
        model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                       max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]))
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    clock.times[-1] = time.perf_counter()  # the last token exists once generate returns
    return clock.times


def run_hf_sequential(model, reqs: list[Req], run: Run, cap: int) -> None:
    run.reqs = reqs[:cap]
    run.extra["note"] = f"first {len(run.reqs)} requests only (rate metrics are valid, latency optimistic)"
    run.start = time.perf_counter()
    for r in run.reqs:
        now = time.perf_counter() - run.start
        if r.arrival > now:
            time.sleep(r.arrival - now)
        ts = _hf_generate(model, [r.prompt], r.max_tokens)
        run.token_times.append(ts[: r.max_tokens])
    run.end = time.perf_counter()


def run_hf_static(model, reqs: list[Req], run: Run, batch: int) -> None:
    run.token_times = [[] for _ in reqs]
    run.extra["static_batch"] = batch
    run.start = time.perf_counter()
    for b in range(0, len(reqs), batch):
        grp = list(range(b, min(b + batch, len(reqs))))
        ts = _hf_generate(model, [reqs[i].prompt for i in grp], max(reqs[i].max_tokens for i in grp))
        for i in grp:  # a request's useful tokens are its first max_tokens; the rest is padding waste
            run.token_times[i] = ts[: reqs[i].max_tokens]
    run.end = time.perf_counter()


def run_hf_cb(model, reqs: list[Req], run: Run, max_batch_tokens: int) -> None:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=-1,
                          pad_token_id=0)
    cbc = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    run.token_times = [[] for _ in reqs]
    with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cbc,
                                                   block=True, timeout=60) as mgr:
        run.start = time.perf_counter()
        pending = {}
        for i, r in enumerate(reqs):
            now = time.perf_counter() - run.start
            if r.arrival > now:
                time.sleep(r.arrival - now)
            rid = mgr.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                  record_timestamps=True)
            pending[rid or f"r{i}"] = i
        while pending:
            res = mgr.get_result(timeout=120)
            if res is None:
                raise RuntimeError("transformers-cb stopped producing results")
            if res.is_finished() and res.request_id in pending:
                i = pending.pop(res.request_id)
                if res.error:
                    raise RuntimeError(res.error)
                run.token_times[i] = list(res.timestamps or [])[: reqs[i].max_tokens]
        run.end = time.perf_counter()


# ------------------------------------------------------------------------ tokenmill
def make_engine(path: str, device: str, prefix: bool, max_num_seqs=None, max_num_batched_tokens=None,
                optimize=None, kv_cache_memory=1024 * 2**20, dtype=torch.float32):
    from gpu_consumers.engine import Engine

    return Engine.from_pretrained(path, device=device, dtype=dtype, enable_prefix_caching=prefix,
                                  kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens, optimize=optimize)


def run_tokenmill(engine, reqs: list[Req], run: Run, concurrency: int | None = None) -> None:
    """Open loop by each request's arrival time, or with `concurrency` a closed loop: the next
    request is admitted as soon as fewer than that many are in flight."""
    from gpu_consumers.engine import SamplingParams

    engine.step_trace = []
    run.token_times = [[] for _ in reqs]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    nxt = 0
    in_flight: set[str] = set()
    q0 = engine.stats
    run.start = time.perf_counter()
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - run.start
        while nxt < len(order) and (len(in_flight) < concurrency if concurrency else reqs[order[nxt]].arrival <= now):
            i = order[nxt]
            engine.add_request(str(i), reqs[i].prompt,
                               SamplingParams(max_tokens=reqs[i].max_tokens, temperature=0.0, ignore_eos=True))
            if concurrency:
                in_flight.add(str(i))
                run.admitted[i] = time.perf_counter()
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, reqs[order[nxt]].arrival - (time.perf_counter() - run.start)))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                run.token_times[int(o.request_id)].extend([t] * len(o.new_token_ids))
            if o.finished:
                in_flight.discard(o.request_id)
    run.end = time.perf_counter()
    st = engine.stats
    q = st["prefix_cache_queries"] - q0["prefix_cache_queries"]
    h = st["prefix_cache_hits"] - q0["prefix_cache_hits"]
    dec = [x for x in engine.step_trace if x[0] == x[1]]
    run.extra.update({
        "prefix_hit_rate": h / q if q else 0.0,
        "preemptions": st["preemptions"] - q0["preemptions"],
        "steps": len(engine.step_trace),
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
    })
    if dec:
        run.extra.update({
            "decode_steps": len(dec),
            "decode_step_p50_s": statistics.median(x[2] for x in dec),
            "bare_forward_p50_s": statistics.median(x[3] for x in dec),
            # engine wall time per decode step / bare model forward (+lm_head) of the same batch
            "engine_overhead_ratio": sum(x[2] for x in dec) / sum(x[3] for x in dec),
            "mean_decode_batch": statistics.mean(x[0] for x in dec),
        })


def bare_forward_probe(engine, batch: int, context: int, iters: int = 5) -> dict:
    """Time the bare model forward for a pure decode batch (no scheduler / sampler),
    and the full engine.step() for the same batch."""
    from gpu_consumers.engine import SamplingParams

    rng = random.Random(batch)
    vocab = engine.model.cfg.vocab_size
    for i in range(batch):
        engine.add_request(f"probe{i}", [rng.randrange(3, vocab) for _ in range(context)],
                           SamplingParams(max_tokens=iters + 3, temperature=0.0, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    step_t, fwd_t = [], []
    for _ in range(iters):
        sched = engine.scheduler.schedule()
        inputs = engine.runner.prepare(sched.seqs, sched.num_tokens)
        t0 = time.perf_counter()
        engine.runner.forward_only(inputs)
        fwd_t.append(time.perf_counter() - t0)
        # undo the schedule's allocation effects are harmless: the real step reuses them
        t0 = time.perf_counter()
        engine.run_scheduled(sched)
        step_t.append(time.perf_counter() - t0)
    for i in range(batch):
        engine.abort(f"probe{i}")
    return {"batch": batch, "context": context, "bare_forward_s": statistics.median(fwd_t),
            "engine_step_s": statistics.median(step_t),
            "ratio": statistics.median(step_t) / statistics.median(fwd_t)}


# ------------------------------------------------------------------------------ main
def machine_info(device: str) -> dict:
    import transformers

    info = {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(), "device": device, "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def print_table(results: list[dict]) -> None:
    cols = [("workload", 13, "s"), ("system", 24, "s"), ("num_requests", 5, "d"), ("output_tokens_per_s", 9, ".1f"),
            ("total_tokens_per_s", 9, ".1f"), ("ttft_p50_s", 8, ".3f"), ("ttft_p99_s", 8, ".3f"),
            ("tpot_p50_s", 8, ".4f"), ("itl_p99_s", 8, ".4f"), ("prefix_hit_rate", 6, ".2f"),
            ("engine_overhead_ratio", 6, ".2f")]
    heads = ["workload", "system", "reqs", "out tok/s", "tot tok/s", "TTFT50", "TTFT99", "TPOT50", "ITL99", "hit", "ovh"]
    print(" ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, (_, w, _)) in enumerate(zip(heads, cols))))
    for r in results:
        cells = []
        for i, (k, w, f) in enumerate(cols):
            v = r.get(k)
            s = "-" if v is None else (format(v, f) if f != "s" else str(v))
            cells.append(s.ljust(w) if i < 2 else s.rjust(w))
        print(" ".join(cells))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenmill bench engine", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, same shapes (~10 min on 2 CPU cores)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None,
                    help="HF checkpoint dir (default: random ~34M Llama); e.g. .local/models/smollm2-135m-instruct, "
                         "the real model `make up` serves")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES),
                    help="weights and activations of every system (docs/benchmarks.md: the real model's fp32 vs bf16)")
    ap.add_argument("--json", default=None,
                    help="write results JSON here (default .local/bench/engine.json, which `tokenmill capacity` "
                         "reads; .local/bench/structured.json for a structured-only run)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--sweep", action="store_true",
                    help="also sweep max_num_seqs on the online workload (throughput vs TTFT p99)")
    ap.add_argument("--optimize", default="throughput", choices=["latency", "throughput"],
                    help="engine preset for the tokenmill runs (default throughput: 2048-token steps, as the "
                         "peers get)")
    ap.add_argument("--batches", default="1,16,64", help="batch sizes of the batched workload")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the batched workload (interleaved)")
    ap.add_argument("--peers", default=",".join(f"llama.cpp-{k}" for k in ("F32", "Q8_0", "Q4_1")),
                    help="llama.cpp systems of the batched workload (empty: none)")
    ap.add_argument("--engine-variants", default="tokenmill",
                    help="tokenmill systems of the batched workload, comma-separated: tokenmill (this engine as "
                         "configured), tokenmill-mkl (float32 products by MKL, as before float_linear.py), "
                         "tokenmill-torch-glue (torch's operations between the products, not native_layer_ops.py), "
                         "tokenmill-eager (its compiled decode off), tokenmill-bf16 (bfloat16), "
                         "tokenmill-int8 (int8 projections, docs/benchmarks.md), tokenmill-int8-kv16 (the same with a "
                         "float16 KV cache), tokenmill-kv-bf16 (float32 weights, a bfloat16 KV cache)")
    ap.add_argument("--structured-model", default=None,
                    help="checkpoint (with a tokenizer) for the structured workload (default: the random small "
                         "model, .local/models/small)")
    args = ap.parse_args(argv)

    q = 1 if args.quick else 0
    device = args.device
    systems = [s for s in args.systems.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    structured = "structured" in workloads
    batched = "batched" in workloads
    workloads = [w for w in workloads if w not in ("structured", "batched")]
    if not workloads:
        systems = []
    model_path = args.model or (build_random_model(str(settings.BENCH_CACHE.get() / "random-llama-34m"))
                                if workloads else None)
    if args.sweep and model_path is None:
        ap.error("--sweep needs a checkpoint: --model, or a workload other than structured and batched")
    from transformers import AutoModelForCausalLM

    info = machine_info(device)
    hf = None
    if args.json is None:
        args.json = str(local_dir() / "bench" / ("engine.json" if workloads else
                                               "batched.json" if batched else "structured.json"))
    if any(s.startswith("transformers") for s in systems):
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[args.dtype]).to(device).eval()
    engines = {}
    results = []
    from gpu_consumers.engine.model.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_path).vocab_size if model_path else 0
    info["model"] = model_path
    info["dtype"] = args.dtype
    print(f"machine: {info}")
    runs = bar(total=len(workloads) * len(systems), desc="runs", unit="run")
    for wl in workloads:
        assert model_path is not None  # a workload has its checkpoint: --model or the random one built above
        reqs = make_workload(wl, NUM_REQUESTS[wl][q], vocab)
        for sysname in systems:
            runs.set_description(f"{sysname} / {wl}")
            runs.update()
            run = Run(sysname, wl, reqs)
            t0 = time.perf_counter()
            try:
                if sysname.startswith("transformers") and wl in CONCURRENCY:
                    continue  # the closed loop is the engine's (transformers' generate takes its batch whole)
                if sysname == "transformers-sequential":
                    run_hf_sequential(hf, reqs, run, SEQ_CAP[q])
                elif sysname == "transformers-static":
                    if wl == "online" or wl in CONCURRENCY:
                        continue  # static batching has no notion of arrivals
                    run_hf_static(hf, reqs, run, STATIC_BATCH)
                elif sysname == "transformers-cb":
                    assert hf is not None  # loaded above for every transformers system
                    if hf.config._attn_implementation != "paged|sdpa":
                        hf.set_attn_implementation("paged|sdpa")
                    run_hf_cb(hf, reqs, run, 2048)
                    hf.set_attn_implementation("sdpa")
                else:
                    prefix = sysname.endswith("-on")
                    if sysname not in engines:
                        engines[sysname] = make_engine(model_path, device, prefix, optimize=args.optimize,
                                                       dtype=DTYPES[args.dtype])
                        _warmup(engines[sysname])
                    eng = engines[sysname]
                    run_tokenmill(eng, reqs, run, CONCURRENCY.get(wl))
            except Exception as e:  # report, keep going
                with above_bars():
                    print(f"{sysname}/{wl} failed: {type(e).__name__}: {e}")
                results.append({"system": sysname, "workload": wl, "error": f"{type(e).__name__}: {e}"})
                if sysname == "transformers-cb" and hf is not None:
                    hf.set_attn_implementation("sdpa")
                continue
            r = run.result()
            r["wall_s"] = time.perf_counter() - t0
            results.append(r)
            with above_bars():
                print_table([r])
    runs.close()
    # the bare-forward probes explain the open-loop tables; a closed-loop run alone skips them
    if any(s.startswith("tokenmill") for s in systems) and not set(workloads) <= set(CONCURRENCY) \
            and model_path is not None:
        eng = engines.get("tokenmill-prefix-on") or make_engine(model_path, device, True, optimize="throughput",
                                                                dtype=DTYPES[args.dtype])
        info["bare_forward_probes"] = [bare_forward_probe(eng, b, 300, iters=4) for b in (16, 64)]
    if args.sweep and model_path is not None:
        info["max_num_seqs_sweep"] = sweep(model_path, device, vocab, q)
    out: dict[str, Any] = {"machine": info, "results": results}
    if batched:
        from tokenmill.benchmarks.engine import batched as batched_bench

        bpath = args.model or model_path or build_random_model(str(settings.BENCH_CACHE.get() / "random-llama-34m"))
        info.setdefault("model", bpath)
        out["batched"] = batched_bench.run(
            bpath, device, [int(b) for b in args.batches.split(",") if b], rounds=args.rounds,
            peers=[p for p in args.peers.split(",") if p],
            variants=[v for v in args.engine_variants.split(",") if v], dtype=DTYPES[args.dtype])
    if structured:
        from tokenmill.benchmarks.engine import structured as structured_bench

        out["structured"] = structured_bench.run(args.structured_model or _default_model_dir(), batch=16 if q else 32,
                                                 max_tokens=48 if q else 96, repeats=3 if q else 10,
                                                 rounds=2 if q else 4)
    info["loadavg_end"] = os.getloadavg()
    print()
    if results:
        print_table([r for r in results if "error" not in r])
    if structured:
        print(structured_bench.format_report(out["structured"]))
    if batched:
        print(batched_bench.format_report(out["batched"]))
    write_json(args.json, out)
    return 0


def _default_model_dir() -> str:
    from gpu_consumers.default_model import build_default_model

    return str(build_default_model(local_dir() / "models" / "small", size="small"))


def _warmup(engine) -> None:
    from gpu_consumers.engine import SamplingParams

    engine.generate([[5] * 40, [6] * 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.kv.pool.reset_prefix_cache()


def sweep(model_path: str, device: str, vocab: int, q: int) -> list[dict]:
    out = []
    reqs = make_workload("online", NUM_REQUESTS["online"][q], vocab, seed=1)
    # a higher arrival rate so that the batch size limit matters
    for req in reqs:
        req.arrival /= 3
    for mns in (4, 16, 64):
        eng = make_engine(model_path, device, True, max_num_seqs=mns, max_num_batched_tokens=max(2048, mns))
        _warmup(eng)
        run = Run(f"tokenmill max_num_seqs={mns}", "online-3x", reqs)
        run_tokenmill(eng, reqs, run)
        r = run.result()
        out.append({k: r[k] for k in ("system", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
                                      "tpot_p50_s", "itl_p99_s")} | {"max_num_seqs": mns})
        print(out[-1])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
