"""`tokenmill bench placement`: prefix-aware against cache-blind placement on a pool of two workers.

    tokenmill bench placement [--tenants 8] [--system-words 150] [--requests 96] [--rates 2,4]
        [--max-tokens 16] [--kv-cache-mb 56] [--placements least-loaded,prefix-aware] [--json PATH]

A private stack (its own KRaft broker, chDB directory and ports, as `bench control-plane` starts it) with
two workers of the model `make up` serves, each with one torch thread and a KV cache too small to hold every
tenant's system prompt: at the defaults a prompt is about 570 tokens (36 blocks of 16) and a worker's cache
224 blocks, so one worker holds at most 6 of the 8 tenants' prompts and nothing else. Each tenant has its own system prompt of ``--system-words`` random words; a request is
that prompt plus a short question of its own. Requests arrive interleaved across tenants (tenant i mod N),
as a Poisson stream at each of ``--rates`` per second (the lower one below the pool's capacity, the higher
one above it without prefix hits).

Each placement runs in turn on the same stack (streams restarted with TOKENMILL_STREAMS_PLACEMENT), each
rate with its own set of tenants, so one run's cache does nothing for the next (a tenant's blocks are salted with
its id). Reported per placement: TTFT p50/p90 at the client, the prefix-cache hit rate over the run's
prompt tokens (the workers' tokenmill:prefix_cache_hits_total over queries_total), output tokens/s, and the
gate's placement decisions by reason (tokenmill:placements).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import tempfile
import time
import urllib.request
from pathlib import Path

from infra.config import RANDOM_MODEL_NAME
from infra.paths import local_dir
from tokenmill.benchmarks.harness import report as bench_report
from tokenmill.benchmarks.harness.report import percentile
from tokenmill.benchmarks.harness.stack import PrivateStack
from tokenmill.benchmarks.harness.streaming_client import send_one
from tokenmill.benchmarks.harness.waiting import wait_live
from tokenmill.benchmarks.harness.workload import word_list

POLICIES = ("least-loaded", "prefix-aware")


def scrape(url: str, metric: str) -> dict[str, float]:
    """Every sample of one metric from a Prometheus text page: its label text -> value."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    found = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(metric)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m:
            found[m.group(1) or ""] = float(m.group(2))
    return found


def _total(urls: list[str], metric: str) -> float:
    return sum(sum(scrape(u, metric).values()) for u in urls)


def _placements(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in scrape(url, "tokenmill:placements_total").items():
        labelled = re.search(r'reason="([^"]*)"', labels)
        if labelled is None:
            raise ValueError(f"a tokenmill:placements_total sample without a reason label: {labels!r}")
        reason = labelled.group(1)
        out[reason] = out.get(reason, 0) + value
    return out


def workload(tenants: int, system_words: int, requests: int, seed: int) -> tuple[list[str], list[tuple[int, str]]]:
    """The tenants' system prompts, and the requests as (tenant index, prompt), interleaved."""
    rng = random.Random(seed)
    words = word_list(rng)
    systems = [f"system {t}: " + " ".join(rng.choice(words) for _ in range(system_words)) for t in range(tenants)]
    reqs = [(i % tenants, f"{systems[i % tenants]}\nquestion {i}: "
             + " ".join(rng.choice(words) for _ in range(8))) for i in range(requests)]
    return systems, reqs


async def _run(port: int, model: str, keys: list[str], reqs: list[tuple[int, str]], rate: float,
               max_tokens: int, seed: int):
    import httpx

    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in reqs:
        arrivals.append(t)
        t += rng.expovariate(rate)
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=httpx.Timeout(600, connect=30))

    async def one(i: int, t0: float):
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        tenant, prompt = reqs[i]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0, "stream_options": {"include_usage": True}}
        return await send_one(client, "/v1/completions", {"Authorization": f"Bearer {keys[tenant]}"}, body,
                              False, "steady", t0)

    try:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(i, t0) for i in range(len(reqs))))
        return list(outcomes), time.perf_counter() - t0
    finally:
        await client.aclose()


def summarize(policy: str, outcomes, duration: float, hits: float, queries: float, placed: dict) -> dict:
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok]
    return {
        "placement": policy, "requests": len(outcomes), "failed": len(outcomes) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "prefix_hit_rate": hits / queries if queries else None,
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / duration if duration else None,
        "duration_s": duration, "placements": placed,
    }


def format_table(rows: list[dict]) -> str:
    return "\n".join(bench_report.table(rows, [
        ("placement", -13, "placement", ""), ("req/s", 5, "rate", "g"), ("reqs", 5, "requests", ""), ("failed", 6, "failed", ""),
        ("TTFT p50 s", 10, "ttft_p50_s", ".3f"), ("TTFT p90 s", 10, "ttft_p90_s", ".3f"),
        ("prefix hit", 10, "prefix_hit_rate", ".2f"), ("out tok/s", 9, "output_tokens_per_s", ".1f"),
        ("decisions", -40, lambda r: ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["placements"].items())), "")]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="tokenmill bench placement", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=150, help="words in each tenant's system prompt")
    ap.add_argument("--requests", type=int, default=96, help="requests per placement and rate")
    ap.add_argument("--rates", default="2,4", help="requests per second (Poisson), one run each")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-cache-mb", type=float, default=56, help="KV cache of each worker")
    ap.add_argument("--model-size", choices=["tiny", "small"], default="small")
    ap.add_argument("--placements", default=",".join(POLICIES), help="run in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(local_dir() / "bench" / "placement.json"))
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.placements.split(",") if p.strip()]
    if not policies or not set(policies) <= set(POLICIES):
        ap.error(f"--placements takes {', '.join(POLICIES)}")
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        ap.error("--rates takes numbers, e.g. 2,4")
    if min(args.tenants, args.system_words, args.requests, args.max_tokens) < 1 or not rates or min(rates) <= 0:
        ap.error("counts, sizes and rates must be positive")

    from tokenmill.stack.processes import exit_cleanly_on_termination

    exit_cleanly_on_termination()
    stack = PrivateStack(Path(tempfile.mkdtemp(prefix="tokenmill-placement-")), model_name=RANDOM_MODEL_NAME)
    rows: list[dict] = []
    print(f"starting a private stack with two workers in {stack.work} ...", flush=True)
    try:
        stack.start(1, model_size=args.model_size, kv_cache_mb=args.kv_cache_mb, workers=2,
                    env_extra={"TOKENMILL_STREAMS_PLACEMENT": policies[0]})
        streams_url = f"http://127.0.0.1:{stack.services['streams'].env['TOKENMILL_STREAMS_METRICS_PORT']}/metrics"
        worker_urls = [f"http://127.0.0.1:{p}/metrics" for p in stack.worker_metrics_ports]
        _, reqs = workload(args.tenants, args.system_words, args.requests, args.seed)
        warm_key = stack.tenant_key("placement-warmup", 1000, 60)
        wait_live(stack.port, stack.model_name, warm_key)
        # unrecorded: the first forward passes of a fresh worker are the slowest
        warm_outcomes, _ = asyncio.run(_run(stack.port, stack.model_name, [warm_key], [(0, "warm up " * 40)] * 8,
                                            4.0, args.max_tokens, args.seed))
        for policy in policies:
            if policy != policies[0]:
                stack.restart("streams", {"TOKENMILL_STREAMS_PLACEMENT": policy}, "scheduler active")
            # a fresh gate owner places by load until the workers' next cache summaries (every 2 s)
            time.sleep(3)
            for r, rate in enumerate(rates):
                keys = [stack.tenant_key(f"placement-{policy}-{r}-{t}", 1000, 60) for t in range(args.tenants)]
                wait_live(stack.port, stack.model_name, keys[-1])
                hits0, queries0 = (_total(worker_urls, "tokenmill:prefix_cache_hits_total"),
                                   _total(worker_urls, "tokenmill:prefix_cache_queries_total"))
                placed0 = _placements(streams_url)
                print(f"{policy}: {len(reqs)} requests at {rate:g}/s ...", flush=True)
                outcomes, duration = asyncio.run(_run(stack.port, stack.model_name, keys, reqs, rate,
                                                      args.max_tokens, args.seed))
                placed = {k: v - placed0.get(k, 0) for k, v in _placements(streams_url).items()
                          if v - placed0.get(k, 0)}
                row = summarize(policy, outcomes, duration,
                                _total(worker_urls, "tokenmill:prefix_cache_hits_total") - hits0,
                                _total(worker_urls, "tokenmill:prefix_cache_queries_total") - queries0, placed)
                row["rate"] = rate
                rows.append(row)
                print(format_table([row]).splitlines()[-1], flush=True)
    finally:
        stack.stop()
    machine = bench_report.machine()
    print(f"\nplacement on two workers ({args.model_size} model, 1 torch thread, {args.kv_cache_mb:g} MB KV cache "
          f"each), streams, ingress, billing, one KRaft broker and the load generator on {machine['cpus']} cores; "
          f"{args.tenants} tenants x {args.system_words}-word system prompts, {args.requests} requests per run, "
          f"{args.max_tokens} tokens each\n")
    print(format_table(rows))
    ratios = {}
    for rate in rates:
        by = {r["placement"]: r for r in rows if r["rate"] == rate}
        if len(by) == 2 and all(by[p]["ttft_p50_s"] and by[p]["output_tokens_per_s"] for p in POLICIES):
            ratio = {"ttft_p50": by["prefix-aware"]["ttft_p50_s"] / by["least-loaded"]["ttft_p50_s"],
                     "output_tokens_per_s": by["prefix-aware"]["output_tokens_per_s"]
                     / by["least-loaded"]["output_tokens_per_s"]}
            ratios[f"{rate:g}"] = ratio
            print(f"at {rate:g} req/s, prefix-aware / least-loaded: TTFT p50 {ratio['ttft_p50']:.2f}x, "
                  f"output tok/s {ratio['output_tokens_per_s']:.2f}x")
    result = {"machine": machine, "config": vars(args), "runs": rows, "prefix_aware_over_least_loaded": ratios,
              "warmup_failed": sum(not o.ok for o in warm_outcomes)}
    bench_report.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
