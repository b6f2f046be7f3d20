"""`tokenmill queue`: a live table of the queue in front of the GPU pool.

Reads the active streams instance's Prometheus endpoint (``--url``, default
``http://127.0.0.1:$TOKENMILL_STREAMS_METRICS_PORT/metrics``) and shows, per tenant and
class, how many requests wait, how many were released, shed and rejected; per tenant, the
slots it holds and the preemptions streams asked of it; plus the credits per model, the
fairness index and the queue-wait percentiles. ``--once`` prints one table and exits.
"""
from __future__ import annotations

import argparse
import sys
import time

from infra.queue_metrics import fetch, summarize
from infra import settings


def render(summary: dict) -> str:
    lines = []
    state = {True: "active", False: "standby (no queue here)", None: "unknown"}[summary["active"]]
    lines.append(f"streams: {state}   released, not yet ended: {int(summary['in_flight'])}")
    lines.append("")
    lines.append(f"{'model':<24}{'credits':>9}{'in transit':>12}")
    for model, m in sorted(summary["models"].items()):
        lines.append(f"{model:<24}{int(m.get('credits', 0)):>9}{int(m.get('in_transit', 0)):>12}")
    lines.append("")
    lines.append(f"{'tenant':<24}{'class':<13}{'queued':>8}{'released':>10}{'shed':>7}{'rejected':>10}")
    for (tenant, prio), r in sorted(summary["rows"].items()):
        lines.append(f"{tenant:<24}{prio:<13}{int(r.get('queued', 0)):>8}{int(r.get('released', 0)):>10}"
                     f"{int(r.get('shed', 0)):>7}{int(r.get('rejected', 0)):>10}")
    if summary["tenants"]:
        lines.append("")
        lines.append(f"{'tenant':<24}{'running':>9}{'preempted (fairness)':>22}{'(priority)':>12}")
        for tenant, t in sorted(summary["tenants"].items()):
            lines.append(f"{tenant:<24}{int(t.get('running', 0)):>9}{int(t.get('preempted_fairness', 0)):>22}"
                         f"{int(t.get('preempted_priority', 0)):>12}")
    if summary["fairness"]:
        f = summary["fairness"]
        lines.append(f"fairness over the last minute: Jain's index {f.get('jain', 1.0):.3f}, "
                     f"max service difference {f.get('max_difference', 0.0):.0f} weighted tokens")
    if summary["waits"]:
        lines.append("")
        for prio, w in sorted(summary["waits"].items()):
            fmt = lambda v: "-" if v is None else ("inf" if v == float("inf") else f"{v * 1000:.0f} ms")  # noqa: E731
            lines.append(f"queue wait {prio:<12} p50 <= {fmt(w[0.5])}   p99 <= {fmt(w[0.99])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    port = settings.STREAMS_METRICS_PORT.get()
    parser = argparse.ArgumentParser(prog="tokenmill queue", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=f"http://127.0.0.1:{port}/metrics")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--once", action="store_true", help="print one table and exit")
    args = parser.parse_args(argv)
    while True:
        try:
            table = render(summarize(fetch(args.url)))
        except OSError as exc:
            table = f"cannot read {args.url}: {exc}"
            if args.once:
                print(table, file=sys.stderr)
                return 1
        if args.once:
            print(table)
            return 0
        sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S  tokenmill queue\n\n") + table + "\n")
        sys.stdout.flush()
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
