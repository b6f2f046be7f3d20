"""`tokenmill bench control-plane`: the highest request rate the control plane holds, with zero loss.

    tokenmill bench control-plane [--rates 50,100,150,231,300] [--seconds 20] [--max-tokens 2]
        [--prompt-words 8] [--slo-p99-ms 1000] [--json PATH]

The control plane is everything but the model: ingress (HTTP, auth, admission), Kafka, streams
(the authoritative quota and the fair queue), the worker's Kafka plumbing and the billing pipeline.
To measure it rather than the model, the benchmark starts a whole private stack (its own KRaft
broker, chDB directory and ports, so a running `make up` is not disturbed) with the fast model
configuration: the tiny random Llama, short prompts and a couple of output tokens per request.

For each rate it creates a fresh tenant with limits far above the load, sends Poisson arrivals
for `--seconds` (open loop: a request's latency counts from its scheduled arrival, so a backlog
shows up as latency instead of being hidden by a slower sender), then reads every answered
request back from the billing ledger. A rate is *held* when
  - every request was answered 200 (no 429/503, no error),
  - the ledger has exactly one row per answered request, with the token counts the client saw,
    and no row for a request the client did not see answered (zero loss, billed once),
  - end-to-end latency p99 is within --slo-p99-ms (a control plane falling behind shows as a
    growing backlog, so its latency grows without bound).
The load generator is a lean asyncio HTTP/1.1 client on the same machine, and it is counted:
its CPU is CPU the services do not get.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
import urllib.request
from pathlib import Path

from infra.paths import local_dir
from tokenmill.progress import above_bars, bar
from tokenmill.benchmarks.harness import report as bench_report
from tokenmill.benchmarks.harness.client import MODEL_NAME, Answer, open_loop
from tokenmill.benchmarks.harness.report import percentile
from tokenmill.benchmarks.harness.stack import ADMIN_TOKEN, PrivateStack


# ------------------------------------------------------------------------------ ledger
def _admin_get(billing_url: str, path: str) -> list[dict]:
    req = urllib.request.Request(billing_url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def compare_ledger(answers: list[Answer], rows: list[dict]) -> dict:
    """What the client was answered against what the ledger billed: each answered request must be
    billed exactly once, as finished, with the completion tokens the client saw, and nothing else."""
    answered = {a.request_id: a for a in answers if a.status == 200 and a.request_id}
    billed = {r["request_id"]: r for r in rows if r["status"] == "finished"}
    missing = sorted(set(answered) - set(billed))
    unexpected = sorted(set(billed) - set(answered))
    wrong_tokens = sorted(rid for rid, a in answered.items() if rid in billed
                          and billed[rid]["completion_tokens"] != a.completion_tokens)
    other_rows = [r for r in rows if r["status"] != "finished"]
    repeated = len(rows) - len({r["request_id"] for r in rows})
    return {"answered": len(answered), "ledger_rows": len(rows), "billed_finished": len(billed),
            "missing_from_ledger": len(missing), "billed_but_not_answered": len(unexpected),
            "token_mismatches": len(wrong_tokens), "non_finished_rows": len(other_rows),
            "repeated_rows": repeated,
            "examples": {"missing": missing[:5], "unexpected": unexpected[:5], "wrong_tokens": wrong_tokens[:5]}}


def reconcile(billing_url: str, tenant_id: str, answers: list[Answer], wait_s: float = 60.0) -> dict:
    """compare_ledger once billing has caught up (or wait_s has passed)."""
    answered = {a.request_id for a in answers if a.status == 200 and a.request_id}
    deadline = time.monotonic() + wait_s
    while True:
        rows = _admin_get(billing_url, f"/admin/ledger/requests?since=1d&tenant_id={tenant_id}&limit=1000000")
        if answered <= {r["request_id"] for r in rows} or time.monotonic() > deadline:
            return compare_ledger(answers, rows)
        time.sleep(1.0)


# ------------------------------------------------------------------------------ report
def step_result(rate: float, seconds: float, answers: list[Answer], span_s: float, ledger: dict,
                slo_p99_ms: float) -> dict:
    ok = [a for a in answers if a.status == 200]
    lat = [a.latency_s * 1000 for a in ok if a.latency_s is not None]
    errors: dict[str, int] = {}
    for a in answers:
        if a.status != 200:
            key = a.error or str(a.status)
            errors[key] = errors.get(key, 0) + 1
    p99 = percentile(lat, 99)
    lossless = all(ledger[k] == 0 for k in ("missing_from_ledger", "billed_but_not_answered", "token_mismatches",
                                             "non_finished_rows", "repeated_rows"))
    held = bool(ok) and len(ok) == len(answers) and lossless and p99 is not None and p99 <= slo_p99_ms
    return {"offered_rate": rate, "seconds": seconds, "sent": len(answers), "ok": len(ok), "errors": errors,
            "achieved_rate": len(ok) / span_s if span_s > 0 else None, "span_s": span_s,
            "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": p99,
                           "max": max(lat) if lat else None},
            "ledger": ledger, "lossless": lossless, "held": held}


def format_table(steps: list[dict]) -> str:
    columns = [("offered/s", 9, "offered_rate", "g"), ("sent", 6, "sent", ""), ("ok", 6, "ok", ""),
               ("errors", 7, lambda s: sum(s["errors"].values()), ""), ("achieved/s", 10, "achieved_rate", ".1f"),
               ("p50 ms", 8, lambda s: s["latency_ms"]["p50"], ".1f"),
               ("p90 ms", 8, lambda s: s["latency_ms"]["p90"], ".1f"),
               ("p99 ms", 8, lambda s: s["latency_ms"]["p99"], ".1f"),
               ("ledger", 7, lambda s: s["ledger"]["billed_finished"], ""),
               ("missing", 7, lambda s: s["ledger"]["missing_from_ledger"], ""),
               ("extra", 6, lambda s: s["ledger"]["billed_but_not_answered"], ""),
               ("held", 5, lambda s: "yes" if s["held"] else "NO", "")]
    lines = []
    for i, step in enumerate(steps):
        rendered = bench_report.table([step], columns)
        lines += rendered if i == 0 else rendered[2:]
        if step["errors"]:
            lines.append(f"{'':>9} errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(step["errors"].items())))
    if not steps:
        lines = bench_report.table([], columns)
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CPU
def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process and its children (streams runs under a
    supervisor, so its own pid does no work)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    snap = {name: cpu_seconds(pid) for name, pid in pids.items()}
    snap["load generator"] = time.process_time()
    return snap


def cpu_share(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Cores each process used on average over wall_s (1.0 = one core busy all the time)."""
    return {name: (after[name] - before[name]) / wall_s for name in before} if wall_s > 0 else {}


def hop_table(stack: PrivateStack, api_key: str, n: int, max_tokens: int) -> dict:
    """TTFT of `n` lone streamed requests, broken down by hop (tokenmill/benchmarks/platform/hop_latency.py); printed and returned."""
    from tokenmill.benchmarks.platform import hop_latency

    samples = []
    for i in range(n):
        samples.append(hop_latency.send_streamed(stack.port, api_key, MODEL_NAME, f"hop {i} a b c d e f",
                                                 max_tokens))
        time.sleep(0.2)  # alone in the system: each request finds every process idle
    table = hop_latency.summary(hop_latency.breakdown(samples))
    print("\n" + hop_latency.format_summary(f"TTFT of {n} lone streamed requests, by hop (event timestamps, ms):",
                                            table) + "\n", flush=True)
    return table


# ------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="tokenmill bench control-plane", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50,100,150,231,300", help="comma-separated offered rates, requests/s")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each step")
    ap.add_argument("--max-tokens", type=int, default=2, help="output tokens per request (ignore_eos, exact)")
    ap.add_argument("--prompt-words", type=int, default=8)
    ap.add_argument("--slo-p99-ms", type=float, default=1000.0, help="end-to-end p99 a held rate must stay within")
    ap.add_argument("--worker-threads", type=int, default=1, help="torch threads of the worker")
    ap.add_argument("--hops", type=int, default=40,
                    help="first send this many streamed requests one at a time and break their TTFT down by hop")
    ap.add_argument("--stop-after-miss", action="store_true", help="stop at the first rate not held")
    ap.add_argument("--json", default=str(local_dir() / "bench" / "control_plane.json"))
    args = ap.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        ap.error("--rates must be comma-separated numbers")
    if not rates or any(r <= 0 or math.isinf(r) for r in rates):
        ap.error("--rates must be positive and finite")
    if args.seconds <= 0 or args.max_tokens < 1 or args.prompt_words < 1:
        ap.error("--seconds, --max-tokens and --prompt-words must be positive")

    from tokenmill.stack.processes import exit_cleanly_on_termination

    exit_cleanly_on_termination()
    stack = PrivateStack(Path(tempfile.mkdtemp(prefix="tokenmill-control-plane-")))
    steps: list[dict] = []
    hops: dict = {}
    print(f"starting a private stack in {stack.work} ...", flush=True)
    try:
        stack.start(args.worker_threads)
        warm_key = stack.tenant_key("cp-warmup", 20, 5)
        stack.wait_key_live(warm_key)
        asyncio.run(open_loop(stack.port, warm_key, 20, 3, args.max_tokens, args.prompt_words, seed=1))
        if args.hops > 0:
            hops = hop_table(stack, warm_key, args.hops, args.max_tokens)
        steps_bar = bar(total=len(rates), desc="rates", unit="rate")
        for n, rate in enumerate(rates):
            tenant = f"cp-{n}-{int(rate)}"
            key = stack.tenant_key(tenant, rate, args.seconds)
            probes = stack.wait_key_live(key)
            steps_bar.set_description(f"rate {rate:g}/s for {args.seconds:g} s")
            before = cpu_snapshot(stack.pids())
            answers, span = asyncio.run(open_loop(stack.port, key, rate, args.seconds, args.max_tokens,
                                                  args.prompt_words, seed=100 + n))
            cores = cpu_share(before, cpu_snapshot(stack.pids()), span)
            ledger = reconcile(stack.billing_url, tenant, answers + probes)
            steps.append(step_result(rate, args.seconds, answers, span, ledger, args.slo_p99_ms))
            steps[-1]["cores_used"] = cores
            steps_bar.update()
            with above_bars():
                print(format_table(steps[-1:]).splitlines()[-1], flush=True)
            if args.stop_after_miss and not steps[-1]["held"]:
                break
        steps_bar.close()
    finally:
        stack.stop()
    held = [s["offered_rate"] for s in steps if s["held"]]
    best = max(held) if held else None
    machine = bench_report.machine()
    print(f"\ncontrol plane: one ingress, one streams, one worker (tiny model, {args.worker_threads} torch thread), "
          f"billing, one KRaft broker and the load generator on {machine['cpus']} cores; "
          f"{args.prompt_words}-word prompts, {args.max_tokens} output tokens, non-streaming, "
          f"{args.seconds:g} s per rate\n")
    print(format_table(steps))
    print("\ncores used during each step (1.00 = one core busy the whole step):")
    names = list(steps[0]["cores_used"]) if steps else []
    print(f"{'offered/s':>9} " + " ".join(f"{n:>14}" for n in names) + f" {'total':>8}")
    for s in steps:
        c = s["cores_used"]
        print(f"{s['offered_rate']:>9g} " + " ".join(f"{c.get(n, 0):>14.2f}" for n in names)
              + f" {sum(c.values()):>8.2f}")
    print(f"\nhighest rate held (all answered 200, ledger exact, p99 <= {args.slo_p99_ms:g} ms): "
          f"{'none' if best is None else f'{best:g} requests/s'}")
    result = {"machine": machine, "config": vars(args), "hops_ms": hops, "steps": steps, "highest_rate_held": best}
    bench_report.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
