"""`tokenmill bench serve`: load-test a running tokenmill over HTTP, the way `vllm bench serve` does.

    tokenmill bench serve [--base-url URL] [--api-key KEY] [--model NAME]
        [--num-prompts 200] [--request-rate 4 | inf] [--burstiness 1.0] [--max-concurrency N]
        [--input-len 256] [--output-len 64] [--range-ratio 0.0] [--prefix-len 0] | [--dataset FILE.jsonl]
        [--spike [--spike-factor 5 --spike-start 10 --spike-duration 10]]
        [--goodput ttft:500 tpot:100 e2el:5000] [--compare-engine MODEL_DIR]
        [--compare-llama-server F32|Q8_0|Q4_1 [--llama-server-slots N] [--llama-server-threads N]] [--json PATH]

Every request streams (SSE), so each one yields a TTFT, its inter-token latencies and an
end-to-end latency; token counts come from the `usage` chunk (`stream_options.include_usage`).
Prompts are random words (the served model's tokenizer is not available remotely); every request
sets `ignore_eos: true` so that its output is exactly `max_tokens` long.

429 and 503 answers are the platform doing its job under overload (rate limits, queue full,
deadline shedding). They are reported as rejected/shed, apart from real failures.

Metric definitions follow vLLM's `benchmark_serving`:
  TTFT   time from sending the request to the first streamed token
  TPOT   (E2E - TTFT) / (output_tokens - 1), per request: the mean time per output token after the first
  ITL    the gap between two consecutive streamed chunks, pooled over all requests
  E2EL   time from sending the request to its last byte
"""
from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from infra.config import DEFAULT_MODEL_NAME
from infra.paths import local_dir
from tokenmill.progress import bar
from tokenmill.benchmarks.harness.report import percentile, write_json
from tokenmill.benchmarks.harness.streaming_client import Outcome, send_one
from tokenmill.benchmarks.harness.workload import word_list
from tokenmill.stack.local_stack import demo_env_path

DEFAULT_BASE_URL = "http://127.0.0.1:8080/v1"
PERCENTILES = (50, 90, 99)


# ----------------------------------------------------------------------------- workload
@dataclass
class BenchRequest:
    prompt: str
    max_tokens: int
    arrival_s: float = 0.0  # scheduled send time, seconds after the start
    phase: str = "steady"


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, prefix_len: int = 0,
                    seed: int = 0) -> list[BenchRequest]:
    """`n` prompts of random words: a shared `prefix_len`-word prefix plus `input_len` (+-ratio) unique words."""
    if not 0 <= range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    rng = random.Random(seed)
    words = word_list(rng)
    prefix = " ".join(rng.choice(words) for _ in range(prefix_len))
    ins = _lengths(rng, input_len, range_ratio, n)
    outs = _lengths(rng, output_len, range_ratio, n)
    reqs = []
    for i, (k, m) in enumerate(zip(ins, outs)):
        # a leading request number makes every prompt unique past the shared prefix
        body = f"{i} " + " ".join(rng.choice(words) for _ in range(max(0, k - 1)))
        reqs.append(BenchRequest(prompt=f"{prefix} {body}" if prefix else body, max_tokens=m))
    return reqs


def dataset_requests(path: str, n: int | None, default_max_tokens: int) -> list[BenchRequest]:
    """JSON lines with `prompt` (string) and optionally `max_tokens`."""
    reqs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
                max_tokens = int(row.get("max_tokens") or default_max_tokens)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: need a JSON object with 'prompt' ({exc})") from None
            if not isinstance(prompt, str) or max_tokens < 1:
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a string and 'max_tokens' >= 1")
            reqs.append(BenchRequest(prompt=prompt, max_tokens=max_tokens))
            if n is not None and len(reqs) >= n:
                break
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return reqs


def _gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """vLLM's arrivals: gamma-distributed gaps with mean 1/rate; burstiness 1 = Poisson, <1 burstier."""
    if math.isinf(rate):
        return 0.0
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def schedule(reqs: list[BenchRequest], rate: float, burstiness: float = 1.0, seed: int = 0,
             spike: tuple[float, float, float] | None = None) -> list[BenchRequest]:
    """Set each request's arrival time.

    `spike=(factor, start_s, duration_s)`: the rate is `rate` until start_s, `rate * factor` for
    duration_s, and `rate` again after, so the run shows the baseline, the spike and the recovery.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    rng = random.Random(seed + 1)

    def phase_at(t: float) -> tuple[str, float]:
        if spike is None:
            return "steady", rate
        factor, start, duration = spike
        if t < start:
            return "baseline", rate
        if t < start + duration:
            return "spike", rate * factor
        return "after", rate

    t = 0.0  # the first request goes at t=0, like vLLM
    for i, r in enumerate(reqs):
        if i:
            t += _gap(rng, phase_at(t)[1], burstiness)
        r.arrival_s, r.phase = t, phase_at(t)[0]
    return reqs


# ------------------------------------------------------------------------------ client
def _body(req: BenchRequest, model: str, endpoint: str, temperature: float, seed: int | None) -> dict:
    body = {"model": model, "max_tokens": req.max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "temperature": temperature}
    if seed is not None:
        body["seed"] = seed
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def run_http(reqs: list[BenchRequest], base_url: str, api_key: str, model: str, endpoint: str = "completions",
                   max_concurrency: int | None = None, temperature: float = 0.0, seed: int | None = None,
                   timeout_s: float = 600.0, progress: bool = False) -> tuple[list[Outcome], float]:
    import httpx

    chat = endpoint == "chat"
    url = base_url.rstrip("/") + ("/chat/completions" if chat else "/completions")
    headers = {"Authorization": f"Bearer {api_key}"}
    limit = max_concurrency or max(len(reqs), 1)
    sem = asyncio.Semaphore(limit)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0),
                               limits=httpx.Limits(max_connections=limit + 8, max_keepalive_connections=limit + 8))
    ended = bar(total=len(reqs), desc="requests", unit="req", enabled=progress)

    async def one(req: BenchRequest, t0: float) -> Outcome:
        delay = t0 + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem:
            out = await send_one(client, url, headers, _body(req, model, endpoint, temperature, seed), chat,
                                 req.phase, t0)
        ended.update()
        return out

    try:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(r, t0) for r in reqs))
        duration = time.perf_counter() - t0
    finally:
        ended.close()
        await client.aclose()
    return list(outcomes), duration


# ----------------------------------------------------------------------------- metrics
def _dist_ms(xs: list[float]) -> dict:
    out = {"mean": (sum(xs) / len(xs) * 1000) if xs else None}
    for q in PERCENTILES:
        p = percentile(xs, q)
        out[f"p{q}"] = None if p is None else p * 1000
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:100"]` -> {"ttft": 500.0, "tpot": 100.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            name, sep, value = part.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"bad --goodput item {part!r}: use ttft:MS, tpot:MS or e2el:MS")
            try:
                slos[name] = float(value)
            except ValueError:
                raise ValueError(f"bad --goodput value {part!r}: not a number") from None
            if slos[name] <= 0:
                raise ValueError(f"bad --goodput value {part!r}: must be > 0")
    return slos


def ttfts(ok: list[Outcome]) -> list[float]:
    """The TTFTs of successful outcomes (every one has one: a success is a stream that carried a token)."""
    return [o.ttft_s for o in ok if o.ttft_s is not None]


def e2els(ok: list[Outcome]) -> list[float]:
    """The end-to-end latencies of successful outcomes (every one has one)."""
    return [o.e2el_s for o in ok if o.e2el_s is not None]


def meets_slo(o: Outcome, slos: dict[str, float]) -> bool:
    if not o.ok:
        return False
    values = {"ttft": o.ttft_s, "tpot": o.tpot_s if o.tpot_s is not None else 0.0, "e2el": o.e2el_s}
    return all((value := values[k]) is not None and value * 1000 <= v for k, v in slos.items())


def summarize(outcomes: list[Outcome], duration_s: float,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    cats = Counter(o.category for o in outcomes)
    errors = {cat: dict(Counter(o.error_key for o in outcomes if o.category == cat))
              for cat in ("rejected", "shed", "failed") if cats.get(cat)}
    in_tok = sum(o.prompt_tokens for o in ok)
    out_tok = sum(o.output_tokens for o in ok)
    res: dict[str, Any] = {
        "num_requests": len(outcomes), "completed": len(ok), "rejected": cats.get("rejected", 0),
        "shed": cats.get("shed", 0), "failed": cats.get("failed", 0), "errors": errors,
        "duration_s": duration_s, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tok / duration_s if duration_s > 0 else None,
        "total_token_throughput": (in_tok + out_tok) / duration_s if duration_s > 0 else None,
        "ttft_ms": _dist_ms(ttfts(ok)),
        "tpot_ms": _dist_ms([o.tpot_s for o in ok if o.tpot_s is not None]),
        "itl_ms": _dist_ms([x for o in ok for x in o.itl_s]),
        "e2el_ms": _dist_ms(e2els(ok)),
    }
    if slos:
        good = sum(1 for o in ok if meets_slo(o, slos))
        res["goodput_slo_ms"] = slos
        res["good_requests"] = good
        res["request_goodput"] = good / duration_s if duration_s > 0 else None
    phases = sorted({o.phase for o in outcomes}, key=["baseline", "spike", "after", "steady"].index)
    if len(phases) > 1:
        res["phases"] = {}
        for ph in phases:
            sub = [o for o in outcomes if o.phase == ph]
            sub_ok = [o for o in sub if o.ok]
            c = Counter(o.category for o in sub)
            res["phases"][ph] = {"requests": len(sub), "completed": len(sub_ok), "rejected": c.get("rejected", 0),
                                 "shed": c.get("shed", 0), "failed": c.get("failed", 0),
                                 "ttft_ms": _dist_ms(ttfts(sub_ok)),
                                 "e2el_ms": _dist_ms(e2els(sub_ok))}
    return res


def _f(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def format_report(title: str, res: dict) -> str:
    lines = [f"{'=' * 22} {title} {'=' * max(0, 40 - len(title))}"]

    def row(label, value):
        lines.append(f"{label:<52}{value:>14}")

    row("Requests sent:", str(res["num_requests"]))
    row("Successful requests:", str(res["completed"]))
    row("Rejected (429, expected under load):", str(res["rejected"]))
    row("Shed (503, expected under load):", str(res["shed"]))
    row("Failed:", str(res["failed"]))
    row("Benchmark duration (s):", _f(res["duration_s"]))
    row("Total input tokens:", str(res["total_input_tokens"]))
    row("Total generated tokens:", str(res["total_output_tokens"]))
    if res["completed"]:
        row("Mean input tokens per request:", _f(res["total_input_tokens"] / res["completed"], ".1f"))
    row("Request throughput (req/s):", _f(res["request_throughput"]))
    if "request_goodput" in res:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in res["goodput_slo_ms"].items())
        row(f"Request goodput (req/s) [{slo}]:", _f(res["request_goodput"]))
    row("Output token throughput (tok/s):", _f(res["output_throughput"]))
    row("Total token throughput (tok/s):", _f(res["total_token_throughput"]))
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                      ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{'-' * 25}{name}{'-' * max(0, 37 - len(name))}")
        short = key.split("_")[0].upper()
        row(f"Mean {short} (ms):", _f(res[key]["mean"]))
        for q in PERCENTILES:
            row(f"P{q} {short} (ms):", _f(res[key][f"p{q}"]))
    for cat, errs in res["errors"].items():
        lines.append(f"{cat}: " + ", ".join(f"{k} x{v}" for k, v in sorted(errs.items())))
    if "phases" in res:
        lines.append("-" * 62)
        lines.append(f"{'phase':<10}{'sent':>6}{'ok':>6}{'429':>6}{'503':>6}{'fail':>6}{'TTFT p50':>11}{'TTFT p99':>11}")
        for ph, p in res["phases"].items():
            lines.append(f"{ph:<10}{p['requests']:>6}{p['completed']:>6}{p['rejected']:>6}{p['shed']:>6}"
                         f"{p['failed']:>6}{_f(p['ttft_ms']['p50'], '.1f'):>11}{_f(p['ttft_ms']['p99'], '.1f'):>11}")
    lines.append("=" * 64)
    return "\n".join(lines)


# ------------------------------------------------------------------ in-process engine
def run_engine(reqs: list[BenchRequest], model_dir: str, endpoint: str = "completions",
               max_concurrency: int | None = None, temperature: float = 0.0, seed: int | None = None,
               kv_cache_mb: float = 256, optimize: str | None = None, threads: int | None = None,
               max_num_batched_tokens: int | None = None) -> tuple[list[Outcome], float]:
    """The same workload (same prompts, lengths, arrival times) on `gpu_consumers.engine.Engine` in this process.

    The prompts are tokenized the way ingress does it (the chat template for chat; plain encoding
    without special tokens for completions), so the difference to the HTTP run is what the platform
    (HTTP, auth, Kafka, the fair queue, the worker's batching of replies) adds.
    """
    engine, prompts = _engine_and_prompts(reqs, model_dir, endpoint, kv_cache_mb, optimize, threads,
                                          max_num_batched_tokens)
    return _replay(engine, reqs, prompts, max_concurrency, temperature, seed)


def _engine_and_prompts(reqs: list[BenchRequest], model_dir: str, endpoint: str, kv_cache_mb: float,
                        optimize: str | None, threads: int | None, max_num_batched_tokens: int | None):
    import torch

    from gpu_consumers.engine import Engine

    if threads:
        torch.set_num_threads(threads)
    engine = Engine.from_pretrained(model_dir, kv_cache_memory=int(kv_cache_mb * 2**20), optimize=optimize,
                                    max_num_batched_tokens=max_num_batched_tokens)
    tok = engine.tokenizer
    if tok is None:
        raise ValueError(f"{model_dir} has no tokenizer")

    def encode(prompt: str) -> list[int]:
        if endpoint == "chat":
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=False)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(prompt, add_special_tokens=False)

    return engine, [encode(r.prompt) for r in reqs]


def _replay(engine, reqs: list[BenchRequest], prompts: list[list[int]], max_concurrency: int | None,
            temperature: float, seed: int | None) -> tuple[list[Outcome], float]:
    """Each request joins the batch at its arrival (or when a concurrency slot frees), between steps."""
    from gpu_consumers.engine.core.sampling_params import SamplingParams

    engine.generate([prompts[0][:8] or [5]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    outs = [Outcome(phase=r.phase, prompt_tokens=len(p)) for r, p in zip(reqs, prompts)]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    nxt = 0
    t0 = time.perf_counter()
    # When each concurrency slot came free, soonest first. A request's clock starts when its client
    # would have sent it: at its arrival, or when a slot freed if it had to wait for one (the HTTP
    # client's semaphore). It can join the batch only between steps, as in a server, and that wait
    # counts in its TTFT, as it does over HTTP.
    slots = [t0] * (max_concurrency or len(reqs))
    ended = bar(total=len(reqs), desc="engine requests", unit="req")
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(order) and slots and t0 + reqs[order[nxt]].arrival_s <= now:
            i = order[nxt]
            rid = str(i)
            params = SamplingParams(max_tokens=reqs[i].max_tokens, temperature=temperature, ignore_eos=True,
                                    seed=seed if seed is not None else i)
            engine.add_request(rid, prompts[i], params)
            sent[rid] = max(t0 + reqs[i].arrival_s, heapq.heappop(slots))
            outs[i].sent_at_s = sent[rid] - t0
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt < len(order):
                time.sleep(max(0.0, min(0.05, t0 + reqs[order[nxt]].arrival_s - time.perf_counter())))
            continue
        step_outs = engine.step()
        now = time.perf_counter()
        for o in step_outs:
            i = int(o.request_id)
            res = outs[i]
            if o.new_token_ids:
                if res.ttft_s is None:
                    res.ttft_s = now - sent[o.request_id]
                else:
                    res.itl_s.append(now - last[o.request_id])
                last[o.request_id] = now
                res.output_tokens = o.completion_tokens
            if o.finished:
                res.e2el_s = now - sent[o.request_id]
                res.ok = res.ttft_s is not None
                res.status = 200
                heapq.heappush(slots, now)
                ended.update()
    ended.close()
    return outs, time.perf_counter() - t0


def engine_overhead(platform: dict, engine: dict) -> dict:
    """What the platform adds to TTFT (and E2E) over the bare engine on the same workload."""
    out = {}
    for key in ("ttft_ms", "e2el_ms"):
        for q in ("p50", "p99"):
            a, b = platform[key][q], engine[key][q]
            out[f"{key.split('_')[0]}_{q}_overhead_ms"] = None if a is None or b is None else a - b
    return out


# ------------------------------------------------------------------------------- main
def _defaults() -> dict[str, str]:
    env = {}
    if demo_env_path().exists():
        for line in demo_env_path().read_text().splitlines():
            k, sep, v = line.partition("=")
            if sep:
                env[k.strip()] = v.strip()
    for k in ("TOKENMILL_BASE_URL", "TOKENMILL_API_KEY", "TOKENMILL_MODEL"):
        if os.environ.get(k):
            env[k] = os.environ[k]
    return env


def build_parser() -> argparse.ArgumentParser:
    d = _defaults()
    p = argparse.ArgumentParser(prog="tokenmill bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=d.get("TOKENMILL_BASE_URL", DEFAULT_BASE_URL))
    p.add_argument("--api-key", default=d.get("TOKENMILL_API_KEY"))
    p.add_argument("--model", default=d.get("TOKENMILL_MODEL", DEFAULT_MODEL_NAME))
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests/s (Poisson, or gamma with --burstiness); inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier, >1 steadier")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in random words (about tokens)")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens (ignore_eos, so exact)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L*(1-r), L*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=0, help="words of a prefix shared by every prompt")
    p.add_argument("--dataset", default=None, help="JSONL with 'prompt' and optional 'max_tokens' per line")
    p.add_argument("--spike", action="store_true",
                   help="baseline --request-rate, then --spike-factor x for --spike-duration s, then baseline")
    p.add_argument("--spike-factor", type=float, default=5.0)
    p.add_argument("--spike-start", type=float, default=None, help="seconds (default: a third of the run)")
    p.add_argument("--spike-duration", type=float, default=None, help="seconds (default: a sixth of the run)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 e2el:5000 (milliseconds)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="workload seed (prompts, lengths, arrivals)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--compare-engine", metavar="MODEL_DIR", default=None,
                   help="also run the workload in-process on the engine and report the platform's TTFT overhead")
    p.add_argument("--engine-kv-cache-mb", type=float, default=256)
    p.add_argument("--engine-optimize", choices=["latency", "throughput"], default=None)
    p.add_argument("--engine-max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step; match the worker's `--max-num-batched-tokens`")
    p.add_argument("--engine-threads", type=int, default=None,
                   help="torch threads of the in-process engine; match the worker's (default: what `make up` "
                        "gives the worker, one fewer than the cores)")
    p.add_argument("--compare-llama-server", metavar="PRECISION", choices=["F32", "Q8_0", "Q4_1"], default=None,
                   help="also run the workload against llama.cpp's llama-server on the same model as a GGUF of "
                        "this precision (built once under .local/llamacpp), and print tokenmill / llama-server")
    p.add_argument("--llama-server-model-dir", default=str(local_dir() / "models" / "smollm2-135m-instruct"),
                   help="the checkpoint tokenmill serves, converted to GGUF for llama-server")
    p.add_argument("--llama-server-slots", type=int, default=None,
                   help="llama-server's --parallel (default: --max-concurrency, else 16)")
    p.add_argument("--llama-server-threads", type=int, default=None,
                   help="llama-server's threads (default: the tokenmill worker's, one fewer than the cores)")
    p.add_argument("--no-hops", action="store_true",
                   help="skip the per-hop TTFT breakdown (it reads the run's events from Kafka at "
                        "KAFKA_BOOTSTRAP_SERVERS, so it needs the stack's broker)")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def hop_breakdown(outcomes: list[Outcome]) -> dict | None:
    """p50/p90/p99 of each hop of the successful requests' TTFT (tokenmill/benchmarks/platform/hop_latency.py),
    or None when the broker cannot be read."""
    from tokenmill.benchmarks.platform import hop_latency

    samples = [(o.request_id, o.sent_wall_ms, o.first_wall_ms) for o in outcomes
               if o.ok and o.request_id and o.sent_wall_ms is not None and o.first_wall_ms is not None]
    try:
        return hop_latency.summary(hop_latency.breakdown(samples))
    except Exception as exc:  # a remote stack whose broker is not reachable from here
        print(f"no hop breakdown: could not read the run's events from Kafka ({exc})", flush=True)
        return None


def _spike_params(args) -> tuple[float, float, float] | None:
    if not args.spike:
        return None
    if math.isinf(args.request_rate):
        raise ValueError("--spike needs a finite --request-rate (the baseline)")
    if args.spike_factor <= 0:
        raise ValueError("--spike-factor must be > 0")
    # expected run length if all requests came at the baseline rate, split in thirds-ish
    span = args.num_prompts / args.request_rate
    start = args.spike_start if args.spike_start is not None else span / 3
    dur = args.spike_duration if args.spike_duration is not None else span / 6
    return args.spike_factor, start, dur


def run_llama_server(reqs: list[BenchRequest], args) -> dict | None:
    """The same requests against a llama-server on the same model (None, with the reason printed, where
    llama.cpp cannot be built or run here)."""
    from infra.config import local_worker_threads
    from tokenmill.stack.processes import free_port
    from tokenmill.benchmarks.engine import llama_server, llamacpp

    slots = args.llama_server_slots or args.max_concurrency or 16
    threads = args.llama_server_threads or local_worker_threads()
    per_slot = llama_server.tokens_per_slot(args.input_len, args.output_len, args.range_ratio, args.prefix_len)
    try:
        llamacpp.ensure_built()
        gguf = llamacpp.ensure_gguf(args.llama_server_model_dir, args.compare_llama_server)
        print(f"running the same workload against llama-server ({gguf.name}, {slots} slots of {per_slot} tokens, "
              f"{threads} threads) ...", flush=True)
        with llama_server.running(gguf, free_port(), slots, per_slot, threads) as base_url:
            outs, dur = asyncio.run(run_http(reqs, base_url, "unused", "peer", args.endpoint, args.max_concurrency,
                                             args.temperature, None, args.timeout, progress=True))
    except llamacpp.LlamaCppUnavailable as exc:
        print(f"llama-server skipped: {exc}", flush=True)
        return None
    peer = summarize(outs, dur)
    print(format_report(f"llama-server {args.compare_llama_server}", peer))
    return {"gguf": gguf.name, "slots": slots, "tokens_per_slot": per_slot, "threads": threads, "result": peer}


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if args.input_len < 1 or args.output_len < 1 or args.prefix_len < 0:
        parser.error("--input-len and --output-len must be >= 1, --prefix-len >= 0")
    if not args.api_key:
        parser.error("no API key: pass --api-key, set TOKENMILL_API_KEY, or run `make up` (writes .local/demo.env)")
    try:
        slos = parse_goodput(args.goodput)
        spike = _spike_params(args)
        if args.dataset:
            reqs = dataset_requests(args.dataset, args.num_prompts, args.output_len)
        else:
            reqs = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                   args.prefix_len, args.seed)
        schedule(reqs, args.request_rate, args.burstiness, args.seed, spike)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))

    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    print(f"tokenmill bench serve: {len(reqs)} requests to {args.base_url} ({args.endpoint}, model {args.model}), "
          f"rate {rate}, burstiness {args.burstiness:g}, max concurrency {args.max_concurrency or 'none'}"
          + (f", spike x{spike[0]:g} at {spike[1]:.1f}s for {spike[2]:.1f}s" if spike else ""), flush=True)
    outcomes, duration = asyncio.run(run_http(reqs, args.base_url, args.api_key, args.model, args.endpoint,
                                              args.max_concurrency, args.temperature, None, args.timeout,
                                              progress=True))
    res = summarize(outcomes, duration, slos)
    print(format_report("Serving Benchmark Result", res))
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    if math.isinf(config["request_rate"]):
        config["request_rate"] = "inf"
    result: dict[str, Any] = {"config": config, "platform": res}
    if not args.no_hops:
        from tokenmill.benchmarks.platform.hop_latency import format_summary

        hops = hop_breakdown(outcomes)
        if hops is not None:
            print(format_summary("TTFT by hop (event timestamps, ms):", hops), flush=True)
            result["hops_ms"] = hops
    if args.compare_engine:
        from infra.config import local_worker_threads

        print(f"running the same workload in-process on the engine ({args.compare_engine}) ...", flush=True)
        eouts, edur = run_engine(reqs, args.compare_engine, args.endpoint, args.max_concurrency, args.temperature,
                                 None, args.engine_kv_cache_mb, args.engine_optimize,
                                 args.engine_threads or local_worker_threads(), args.engine_max_num_batched_tokens)
        eng = summarize(eouts, edur, slos)
        print(format_report("In-process Engine", eng))
        overhead = engine_overhead(res, eng)
        result["engine"] = eng
        result["overhead"] = overhead
        print("platform overhead over the bare engine (ms): "
              + ", ".join(f"{k.removesuffix('_overhead_ms')} {_f(v, '.1f')}" for k, v in overhead.items()))
    if args.compare_llama_server:
        peer = run_llama_server(reqs, args)
        if peer is not None:
            result["llama_server"] = peer
            from tokenmill.benchmarks.engine import llama_server

            result["vs_llama_server"] = llama_server.compare(res, peer["result"])
            print(llama_server.format_comparison(result["vs_llama_server"]))
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
