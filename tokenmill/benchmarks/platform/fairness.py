"""`tokenmill bench fairness`: isolation at the client while one tenant (or class) floods the pool.

    tokenmill bench fairness [--flood 150] [--flood-tokens 64] [--light 10] [--light-tokens 16]
        [--light-every-s 0.5] [--light-after-s 2] [--model-size small] [--modes on,off] [--json PATH]

On a private stack (its own KRaft broker, chDB directory and ports, as `bench control-plane`
does) with the default model and worker settings of `make up`, two scenarios run, each with
streams' preemption on and off (streams is restarted with TOKENMILL_STREAMS_PREEMPTION=0/1).
An unrecorded warm-up flood runs first: the first flood on a fresh stack is the slowest,
whichever mode it runs in.

* **tenant flood**: tenant A streams ``--flood`` requests of ``--flood-tokens`` tokens at once;
  ``--light-after-s`` later, tenant B sends ``--light`` requests of ``--light-tokens`` tokens, one
  every ``--light-every-s``.
* **class flood**: one tenant streams ``--flood`` batch-class requests, then the same tenant's
  ``--light`` interactive requests arrive the same way.

Reported per run and tenant/class: TTFT p50/p95 measured at the client (request sent to first
token), the light side's TTFT p95 over its flooder's TTFT p50 (target <= 0.25), the light side's
TTFT under the flood against the same requests sent alone to the idle stack, Jain's index and the
maximum service difference over the tenants' output tokens while the light side had work open,
output tokens/s of the whole run (preemption's throughput cost: on vs off), and the preemptions
streams asked for (its tokenmill:queue_preemptions counter).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from infra.paths import local_dir
from tokenmill.progress import above_bars, bar
from tokenmill.benchmarks.harness import report as bench_report
from schedulers.fairness_index import jain_index, max_service_difference
from tokenmill.benchmarks.harness.report import percentile
from tokenmill.benchmarks.harness.stack import PrivateStack
from tokenmill.benchmarks.harness.waiting import wait_live
from infra.config import RANDOM_MODEL_NAME, local_worker_threads


@dataclass
class Stream:
    side: str  # "flood" or "light"
    sent_at: float
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    status: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at


async def _stream(client, key: str, body: dict, stream: Stream) -> None:
    import httpx

    try:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True},
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            stream.status = r.status_code
            if r.status_code != 200:
                stream.error = (await r.aread()).decode()[:200]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stream.error = chunk["error"].get("message")
                    return
                now = time.monotonic()
                for choice in chunk["choices"]:
                    if choice.get("text") or choice.get("finish_reason") is None:
                        stream.token_times.append(now)
                        if stream.first_token_at is None:
                            stream.first_token_at = now
    except httpx.HTTPError as exc:
        stream.error = repr(exc)


async def _run_scenario(port: int, model: str, flood_key: str, light_key: str, args,
                        flood_priority: str) -> list[Stream]:
    import httpx

    limits = httpx.Limits(max_connections=args.flood + args.light + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as client:
        streams: list[Stream] = []
        tasks = []
        t0 = time.monotonic()
        for i in range(args.flood):
            s = Stream("flood", time.monotonic())
            streams.append(s)
            body = {"model": model, "prompt": f"flood request {i} tells a story", "max_tokens": args.flood_tokens,
                    "ignore_eos": True, "temperature": 0.8, "seed": i, "priority": flood_priority, "timeout": 600}
            tasks.append(asyncio.create_task(_stream(client, flood_key, body, s)))
        for i in range(args.light):
            await asyncio.sleep(max(0.0, t0 + args.light_after_s + i * args.light_every_s - time.monotonic()))
            s = Stream("light", time.monotonic())
            streams.append(s)
            body = {"model": model, "prompt": f"light request {i}", "max_tokens": args.light_tokens,
                    "ignore_eos": True, "priority": "interactive", "timeout": 600}
            tasks.append(asyncio.create_task(_stream(client, light_key, body, s)))
        await asyncio.gather(*tasks)
        return streams


async def _alone(port: int, model: str, key: str, args) -> list[Stream]:
    """The light requests one at a time on the idle stack: their TTFT without any flood."""
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        out = []
        for i in range(args.light):
            s = Stream("light", time.monotonic())
            await _stream(client, key, {"model": model, "prompt": f"light request {i}",
                                        "max_tokens": args.light_tokens, "ignore_eos": True}, s)
            out.append(s)
        return out


def _preemptions(metrics_url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tokenmill:queue_preemptions_total")


def summarize(streams: list[Stream], alone_p95: float | None) -> dict:
    def ttfts(side):
        return [s.ttft for s in streams if s.side == side and s.ttft is not None]

    failed = [s for s in streams if s.status != 200 or s.error]
    flood_p50 = percentile(ttfts("flood"), 50)
    light_p95 = percentile(ttfts("light"), 95)
    # Service while the light side had work open: from its first request to its last token.
    light = [s for s in streams if s.side == "light" and s.token_times]
    window = (min(s.sent_at for s in light), max(s.token_times[-1] for s in light)) if light else None
    service = {}
    if window:
        for side in ("flood", "light"):
            service[side] = float(sum(1 for s in streams if s.side == side for t in s.token_times
                                      if window[0] <= t <= window[1]))
    all_times = [t for s in streams for t in s.token_times]
    span = (max(all_times) - min(s.sent_at for s in streams)) if all_times else None
    return {
        "requests": len(streams), "failed": len(failed),
        "failures": [s.error or s.status for s in failed][:5],
        "flood_ttft_p50_s": flood_p50, "flood_ttft_p95_s": percentile(ttfts("flood"), 95),
        "light_ttft_p50_s": percentile(ttfts("light"), 50), "light_ttft_p95_s": light_p95,
        "light_p95_over_flood_p50": (light_p95 / flood_p50) if light_p95 is not None and flood_p50 else None,
        "light_ttft_p95_alone_s": alone_p95,
        "light_p95_vs_alone": (light_p95 / alone_p95) if light_p95 is not None and alone_p95 else None,
        "jain_index_while_light_open": jain_index(list(service.values())) if service else None,
        "max_service_difference_tokens": max_service_difference(service, set(service)) if service else None,
        "output_tokens": len(all_times),
        "output_tok_per_s": (len(all_times) / span) if span else None,
    }


def format_table(rows: list[dict]) -> str:
    return "\n".join(bench_report.table(rows, [
        ("scenario", -13, "scenario", ""), ("preempt", 7, "preemption", ""),
        ("flood p50", 9, "flood_ttft_p50_s", ".2f"), ("flood p95", 9, "flood_ttft_p95_s", ".2f"),
        ("light p50", 9, "light_ttft_p50_s", ".2f"), ("light p95", 9, "light_ttft_p95_s", ".2f"),
        ("l95/f50", 7, "light_p95_over_flood_p50", ".2f"), ("vs alone", 8, "light_p95_vs_alone", ".1f"),
        ("jain", 5, "jain_index_while_light_open", ".2f"), ("max diff", 8, "max_service_difference_tokens", ".0f"),
        ("tok/s", 7, "output_tok_per_s", ".0f"), ("preempts", 8, "preemptions", ".0f"), ("failed", 6, "failed", "")]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="tokenmill bench fairness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", type=int, default=150, help="requests the flooding side sends at once")
    ap.add_argument("--flood-tokens", type=int, default=64)
    ap.add_argument("--light", type=int, default=10, help="requests of the light side")
    ap.add_argument("--light-tokens", type=int, default=16)
    ap.add_argument("--light-every-s", type=float, default=0.5)
    ap.add_argument("--light-after-s", type=float, default=2.0)
    ap.add_argument("--model-size", choices=["tiny", "small"], default="small",
                    help="small = the model `make up` serves")
    ap.add_argument("--modes", default="on,off", help="preemption settings to run, in order")
    ap.add_argument("--scenarios", default="tenant,class")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the unrecorded flood that first warms the stack up (without it the first run "
                         "measured is the slowest, whichever mode it has)")
    ap.add_argument("--json", default=str(local_dir() / "bench" / "fairness.json"))
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not set(modes) <= {"on", "off"} or not set(scenarios) <= {"tenant", "class"} or not modes or not scenarios:
        ap.error("--modes takes on/off, --scenarios takes tenant/class")
    if min(args.flood, args.flood_tokens, args.light, args.light_tokens) < 1:
        ap.error("counts and token numbers must be positive")

    from tokenmill.stack.processes import exit_cleanly_on_termination

    exit_cleanly_on_termination()
    stack = PrivateStack(Path(tempfile.mkdtemp(prefix="tokenmill-fairness-")), model_name=RANDOM_MODEL_NAME)
    rows: list[dict] = []
    print(f"starting a private stack in {stack.work} ...", flush=True)
    try:
        stack.start(local_worker_threads(), model_size=args.model_size, kv_cache_mb=256,
                    env_extra={"TOKENMILL_STREAMS_PREEMPTION": "1" if modes[0] == "on" else "0"})
        metrics_url = f"http://127.0.0.1:{stack.services['streams'].env['TOKENMILL_STREAMS_METRICS_PORT']}/metrics"
        flood_key = stack.tenant_key("fair-flood", 1000, 60)
        light_key = stack.tenant_key("fair-light", 1000, 60)
        wait_live(stack.port, stack.model_name, flood_key)
        wait_live(stack.port, stack.model_name, light_key)
        asyncio.run(_alone(stack.port, stack.model_name, light_key, args))  # warm-up: first requests are slower
        alone = asyncio.run(_alone(stack.port, stack.model_name, light_key, args))
        alone_p95 = percentile([s.ttft for s in alone if s.ttft is not None], 95)
        print(f"light requests alone: TTFT p95 {alone_p95:.3f} s", flush=True)
        if not args.no_warmup:
            print("warm-up flood (not recorded) ...", flush=True)
            asyncio.run(_run_scenario(stack.port, stack.model_name, flood_key, light_key, args, "interactive"))
        current = modes[0]
        runs = bar(total=len(modes) * len(scenarios), desc="scenarios", unit="run")
        for mode in modes:
            if mode != current:
                stack.restart("streams", {"TOKENMILL_STREAMS_PREEMPTION": "1" if mode == "on" else "0"},
                              "scheduler active")
                current = mode
            for scenario in scenarios:
                runs.set_description(f"{scenario} flood, preemption {mode}")
                before = _preemptions(metrics_url)
                streams = asyncio.run(_run_scenario(
                    stack.port, stack.model_name, flood_key, light_key if scenario == "tenant" else flood_key,
                    args, "interactive" if scenario == "tenant" else "batch"))
                row = {"scenario": f"{scenario} flood", "preemption": mode, **summarize(streams, alone_p95),
                       "preemptions": _preemptions(metrics_url) - before}
                rows.append(row)
                runs.update()
                with above_bars():
                    print(format_table([row]).splitlines()[-1], flush=True)
        runs.close()
    finally:
        stack.stop()
    machine = bench_report.machine()
    print(f"\nfairness at the client: one worker ({args.model_size} model, default slots), streams, ingress, "
          f"billing, one KRaft broker and the load generator on {machine['cpus']} cores; flood {args.flood} x "
          f"{args.flood_tokens} tokens, light {args.light} x {args.light_tokens} tokens every "
          f"{args.light_every_s:g} s from {args.light_after_s:g} s\n")
    print(format_table(rows))
    cost = {}
    for scenario in scenarios:
        on = next((r for r in rows if r["scenario"] == f"{scenario} flood" and r["preemption"] == "on"), None)
        off = next((r for r in rows if r["scenario"] == f"{scenario} flood" and r["preemption"] == "off"), None)
        if on and off and on["output_tok_per_s"] and off["output_tok_per_s"]:
            cost[scenario] = 1 - on["output_tok_per_s"] / off["output_tok_per_s"]
            print(f"{scenario} flood: throughput cost of preemption {cost[scenario] * 100:+.1f}% output tok/s")
    result = {"machine": machine, "config": vars(args), "light_alone_ttft_p95_s": alone_p95, "runs": rows,
              "throughput_cost": cost}
    bench_report.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
