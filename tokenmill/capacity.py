"""`tokenmill capacity`: turn a demand forecast into requests/s, tokens/s and a number of workers.

    tokenmill capacity --requests-per-day 20e6 --tokens-per-request 1300 [--output-fraction 0.25]
        [--from-bench BENCH.json [--workload NAME] [--system NAME] | --worker-tokens-per-s X]
        [--headroom 0.3] [--peak-factor 5]

The arithmetic, step by step:
  average requests/s   = requests per day / 86,400
  average tokens/s     = average requests/s x tokens per request, split into input (prompt) and
                         output (completion) by --output-fraction
  peak tokens/s        = average tokens/s x --peak-factor (the spike the fleet must absorb)
  usable per worker    = measured worker tokens/s x (1 - --headroom) (keep that share idle, so a
                         worker at plan load still has latency to spare and a lost worker is absorbed)
  workers              = ceil(peak tokens/s / usable per worker)

A worker's throughput comes from an engine benchmark JSON (`tokenmill bench engine --json`, shape
`{"results": [{"system", "workload", "output_tokens_per_s", "total_tokens_per_s", ...}]}`): the
`tokenmill-prefix-on` row of the workload whose input/output mix is closest to the demand's (one of
decode-heavy / mixed unless --workload says otherwise), its total tokens/s. Without --from-bench,
the last `tokenmill bench engine` run's JSON (.local/bench/engine.json). Or give the rate directly
with --worker-tokens-per-s.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from dataclasses import asdict, dataclass

from infra.paths import local_dir



def last_engine_bench() -> Path:
    """Where `tokenmill bench engine` writes its last result, which capacity reads by default."""
    return local_dir() / "bench" / "engine.json"
SECONDS_PER_DAY = 86_400
DEFAULT_SYSTEM = "tokenmill-prefix-on"
DEFAULT_WORKLOADS = ("decode-heavy", "mixed")
WORK_PARTITIONS = 12  # topics.WORK: one consumer group uses at most this many workers


class CapacityError(ValueError):
    """Bad input, with a message that says what to fix."""


@dataclass
class WorkerRate:
    total_tokens_per_s: float
    source: str
    output_fraction: float | None = None


@dataclass
class Plan:
    requests_per_day: float
    tokens_per_request: float
    output_fraction: float
    headroom: float
    peak_factor: float
    avg_requests_per_s: float
    avg_tokens_per_s: float
    avg_input_tokens_per_s: float
    avg_output_tokens_per_s: float
    peak_requests_per_s: float
    peak_tokens_per_s: float
    peak_output_tokens_per_s: float
    worker_tokens_per_s: float
    worker_rate_source: str
    usable_tokens_per_s_per_worker: float
    workers_for_average: int
    workers_for_peak: int
    tokens_per_day: float
    notes: list[str]


def _positive(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value) or value <= 0:
        raise CapacityError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def rate_from_bench(path: str, workload: str | None = None, system: str = DEFAULT_SYSTEM,
                    output_fraction: float | None = None) -> WorkerRate:
    """A worker's total tokens/s from an engine benchmark JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CapacityError(f"benchmark file not found: {path}") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CapacityError(f"cannot read benchmark JSON {path}: {exc}") from None
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise CapacityError(f"{path} has no 'results' list (expected `tokenmill bench engine --json` output)")
    usable = [r for r in rows if isinstance(r, dict) and r.get("system") == system and "error" not in r
              and isinstance(r.get("total_tokens_per_s"), (int, float)) and r["total_tokens_per_s"] > 0]
    if workload is not None:
        usable = [r for r in usable if r.get("workload") == workload]
    else:
        usable = [r for r in usable if r.get("workload") in DEFAULT_WORKLOADS]
    if not usable:
        have = sorted({f"{r.get('system')}/{r.get('workload')}" for r in rows if isinstance(r, dict)})
        want = workload or " or ".join(DEFAULT_WORKLOADS)
        raise CapacityError(f"{path} has no usable {system} result on {want} (it has: {', '.join(have) or 'none'})")

    def mix(r: dict) -> float | None:
        i, o = r.get("input_tokens"), r.get("output_tokens")
        if isinstance(i, (int, float)) and isinstance(o, (int, float)) and i + o > 0:
            return o / (i + o)
        return None

    mixes = [(r, share) for r in usable if (share := mix(r)) is not None]
    if output_fraction is not None and len(usable) > 1 and len(mixes) == len(usable):
        target = output_fraction
        best, best_share = min(mixes, key=lambda pair: abs(pair[1] - target))
        why = f"its output share {best_share:.0%} is closest to the demand's {output_fraction:.0%}"
    else:
        # without token counts, prefer decode-heavy: decode is the expensive part, so it is the cautious pick
        order: dict[object, int] = {w: i for i, w in enumerate(DEFAULT_WORKLOADS)}
        best = min(usable, key=lambda r: order.get(r.get("workload"), len(order)))
        why = "the only match" if len(usable) == 1 else "decode-heavy is the cautious pick"
    return WorkerRate(float(best["total_tokens_per_s"]),
                      f"{path}: {system} on {best.get('workload')} ({why})", mix(best))


def plan(requests_per_day: float, tokens_per_request: float, worker_tokens_per_s: float,
         output_fraction: float = 0.25, headroom: float = 0.3, peak_factor: float = 5.0,
         rate_source: str = "--worker-tokens-per-s", bench_output_fraction: float | None = None) -> Plan:
    requests_per_day = _positive("--requests-per-day", requests_per_day)
    tokens_per_request = _positive("--tokens-per-request", tokens_per_request)
    worker_tokens_per_s = _positive("worker tokens/s", worker_tokens_per_s)
    peak_factor = _positive("--peak-factor", peak_factor)
    if peak_factor < 1:
        raise CapacityError(f"--peak-factor must be >= 1 (the peak is at least the average), got {peak_factor}")
    if not (isinstance(output_fraction, (int, float)) and 0 <= output_fraction <= 1):
        raise CapacityError(f"--output-fraction must be between 0 and 1, got {output_fraction!r}")
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise CapacityError(f"--headroom must be in [0, 1) (a share of each worker kept free), got {headroom!r}")

    rps = requests_per_day / SECONDS_PER_DAY
    tps = rps * tokens_per_request
    usable = worker_tokens_per_s * (1 - headroom)
    peak_tps = tps * peak_factor
    workers_avg = max(1, math.ceil(tps / usable - 1e-9))
    workers_peak = max(1, math.ceil(peak_tps / usable - 1e-9))
    notes = []
    if bench_output_fraction is not None and abs(bench_output_fraction - output_fraction) > 0.15:
        notes.append(f"the benchmark's output share ({bench_output_fraction:.0%}) differs from the demand's "
                     f"({output_fraction:.0%}); output tokens cost more than input tokens, so re-measure on a "
                     f"workload with this mix before trusting the worker count")
    if workers_peak > WORK_PARTITIONS:
        notes.append(f"{workers_peak} workers exceed the {WORK_PARTITIONS} partitions of `work`: one consumer "
                     f"group uses at most {WORK_PARTITIONS} workers, so add partitions to `work` (and size "
                     f"`requests`/`replies` for the ingress count) before scaling out")
    return Plan(
        requests_per_day=requests_per_day, tokens_per_request=tokens_per_request, output_fraction=output_fraction,
        headroom=headroom, peak_factor=peak_factor, avg_requests_per_s=rps, avg_tokens_per_s=tps,
        avg_input_tokens_per_s=tps * (1 - output_fraction), avg_output_tokens_per_s=tps * output_fraction,
        peak_requests_per_s=rps * peak_factor, peak_tokens_per_s=peak_tps,
        peak_output_tokens_per_s=peak_tps * output_fraction, worker_tokens_per_s=worker_tokens_per_s,
        worker_rate_source=rate_source, usable_tokens_per_s_per_worker=usable, workers_for_average=workers_avg,
        workers_for_peak=workers_peak, tokens_per_day=requests_per_day * tokens_per_request, notes=notes)


def format_plan(p: Plan) -> str:
    def n(v: float, d: int = 1) -> str:
        return f"{v:,.{d}f}"

    rows = [
        ("demand", f"{n(p.requests_per_day, 0)} requests/day x {n(p.tokens_per_request, 0)} tokens",
         f"{n(p.tokens_per_day, 0)} tokens/day"),
        ("average requests/s", f"{n(p.requests_per_day, 0)} / 86,400 s", n(p.avg_requests_per_s)),
        ("average tokens/s", f"{n(p.avg_requests_per_s)} req/s x {n(p.tokens_per_request, 0)}",
         n(p.avg_tokens_per_s)),
        ("  input (prompt) tokens/s", f"x {1 - p.output_fraction:.0%}", n(p.avg_input_tokens_per_s)),
        ("  output (generated) tokens/s", f"x {p.output_fraction:.0%}", n(p.avg_output_tokens_per_s)),
        ("peak requests/s", f"average x {p.peak_factor:g}", n(p.peak_requests_per_s)),
        ("peak tokens/s", f"average x {p.peak_factor:g}", n(p.peak_tokens_per_s)),
        ("  of which output tokens/s", f"x {p.output_fraction:.0%}", n(p.peak_output_tokens_per_s)),
        ("one worker, measured", "total tokens/s", n(p.worker_tokens_per_s)),
        ("one worker, usable", f"x (1 - {p.headroom:g} headroom)", n(p.usable_tokens_per_s_per_worker)),
        ("workers for the average", "ceil(average tokens/s / usable)", str(p.workers_for_average)),
        ("workers for the peak", "ceil(peak tokens/s / usable)", str(p.workers_for_peak)),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{'quantity':<{w0}}  {'how':<{w1}}  {'value':>20}", "-" * (w0 + w1 + 24)]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c:>20}" for a, b, c in rows]
    lines.append("")
    lines.append(f"worker rate from {p.worker_rate_source}")
    lines.append(f"=> plan for {p.workers_for_peak} workers (the fleet at {p.peak_factor:g}x the average load, each "
                 f"worker at most {1 - p.headroom:.0%} busy); {p.workers_for_average} carry the average load.")
    for note in p.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _number(text: str) -> float:
    try:
        return float(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests-per-day", type=_number, required=True, help="e.g. 20e6")
    p.add_argument("--tokens-per-request", type=_number, required=True, help="input + output tokens, e.g. 1300")
    p.add_argument("--output-fraction", type=_number, default=0.25, help="share of the tokens that are generated")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from-bench", metavar="JSON",
                     help=f"an engine benchmark JSON (default: {last_engine_bench()}, where `tokenmill bench engine` "
                          "writes, if it is there)")
    src.add_argument("--worker-tokens-per-s", type=_number, help="one worker's total tokens/s, measured elsewhere")
    p.add_argument("--workload", default=None, help="benchmark workload to use (default: decode-heavy or mixed)")
    p.add_argument("--system", default=DEFAULT_SYSTEM, help="benchmark system to use")
    p.add_argument("--headroom", type=_number, default=0.3, help="share of each worker kept free (0-1)")
    p.add_argument("--peak-factor", type=_number, default=5.0, help="peak load / average load")
    p.add_argument("--json", default=None, help="also write the plan here")
    return p


def main(argv: list[str] | None = None) -> Plan:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.from_bench and args.worker_tokens_per_s is None:
        if not last_engine_bench().exists():
            parser.error("no worker rate to plan with: run `tokenmill bench engine --quick` first (it writes "
                         f"{last_engine_bench()}), or pass --from-bench JSON or --worker-tokens-per-s X")
        args.from_bench = str(last_engine_bench())
    try:
        if args.from_bench:
            rate = rate_from_bench(args.from_bench, args.workload, args.system, args.output_fraction)
        else:
            rate = WorkerRate(args.worker_tokens_per_s, "--worker-tokens-per-s")
        result = plan(args.requests_per_day, args.tokens_per_request, rate.total_tokens_per_s,
                      output_fraction=args.output_fraction, headroom=args.headroom, peak_factor=args.peak_factor,
                      rate_source=rate.source, bench_output_fraction=rate.output_fraction)
    except CapacityError as exc:
        parser.error(str(exc))
    print(format_plan(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(asdict(result), f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
