"""`tokenmill usage ...`: usage summary and token reconciliation.

The billing process owns ClickHouse (chDB: one process per directory), so these commands ask
the billing service over HTTP (``TOKENMILL_BILLING_URL``, admin token from
``TOKENMILL_ADMIN_TOKEN`` or ``.local/admin_token``). ``--direct`` opens ClickHouse itself
instead (only when the billing service is not running, or with a ClickHouse server URL).

    python -m billing_pipeline.cli summary --since 24h [--png usage.png]
    python -m billing_pipeline.cli reconcile --since 1h
    python -m billing_pipeline.cli mtd [--tenant T]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from billing_pipeline import analytics, budget
from billing_pipeline.dashboard.panels import usage_panels


# --- where the numbers come from -------------------------------------------------------
class HttpSource:
    def __init__(self, url: str | None = None, token: str | None = None):
        import httpx

        from billing_pipeline.service import admin_token, billing_url

        self.http = httpx.Client(base_url=url or billing_url(), timeout=60,
                                 headers={"authorization": f"Bearer {token or admin_token()}"})

    def _get(self, path: str, **params):
        r = self.http.get(path, params={k: v for k, v in params.items() if v is not None})
        r.raise_for_status()
        return r.json()

    def summary(self, since_ms, until_ms, limit=10) -> dict:
        return self._get("/admin/usage/summary", since=since_ms, until=until_ms, limit=limit)

    def month_to_date(self, tenant_id=None) -> dict:
        return self._get("/admin/usage/month-to-date", tenant_id=tenant_id)

    def lookup(self, request_ids: list[str]) -> list[dict]:
        out = []
        for i in range(0, len(request_ids), 5000):
            r = self.http.post("/admin/ledger/lookup", json={"request_ids": request_ids[i:i + 5000]})
            r.raise_for_status()
            out += r.json()
        return out

    def requests_in_window(self, since_ms, until_ms) -> list[dict]:
        return self._get("/admin/ledger/requests", since=since_ms, until=until_ms, limit=1_000_000)


class DirectSource:
    def __init__(self, url: str | None = None):
        from billing_pipeline.migrations import migrate
        from billing_pipeline.store import Store

        self.store = Store(url)
        migrate(self.store)

    def summary(self, since_ms, until_ms, limit=10) -> dict:
        return analytics.summary(self.store, since_ms, until_ms, limit=limit)

    def month_to_date(self, tenant_id=None) -> dict:
        return budget.month_to_date_detail(tenant_id, store=self.store)

    def lookup(self, request_ids):
        return analytics.lookup_requests(self.store, request_ids)

    def requests_in_window(self, since_ms, until_ms):
        return analytics.requests_in_window(self.store, since_ms, until_ms)


# --- summary ------------------------------------------------------------------------------
def bar_chart(items: list[tuple[str, float]], width: int = 40, unit: str = "") -> str:
    """A text bar chart: one line per (label, value)."""
    if not items:
        return "(no data)"
    top = max(v for _, v in items) or 1
    label_w = max(len(k) for k, _ in items)
    return "\n".join(f"{k:<{label_w}} {'█' * max(0, round(v / top * width)):<{width}} {v:,.0f}{unit}"
                     for k, v in items)


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    if not rows:
        return "(no data)"
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.6f}" if abs(v) < 1 else f"{v:,.1f}"
        return f"{v:,}" if isinstance(v, int) else str(v)
    cells = [[fmt(r.get(k)) for k, _ in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h) in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) for (_, h), w in zip(cols, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths)))
              for row in cells]
    return "\n".join(lines)


def format_summary(data: dict) -> str:
    usage_cols = [("requests", "requests"), ("tokens", "tokens"), ("input_tokens", "input"),
                  ("cached_tokens", "cached"), ("completion_tokens", "output"), ("cost_usd", "cost USD")]
    parts = ["Tokens and cost by model", _table(data["by_model"], [("model", "model"), *usage_cols]), "",
             bar_chart([(m["model"], m["tokens"]) for m in data["by_model"]], unit=" tok"), "",
             "Top tenants", _table(data["top_tenants"], [("tenant_id", "tenant"), *usage_cols]), "",
             bar_chart([(t["tenant_id"], t["tokens"]) for t in data["top_tenants"]], unit=" tok"), "",
             "Latency by model (finished requests, ms)",
             _table(data["latency"], [("model", "model"), ("requests", "requests"),
                                      ("ttft_p50_ms", "ttft p50"), ("ttft_p95_ms", "p95"), ("ttft_p99_ms", "p99"),
                                      ("tpot_p50_ms", "tpot p50"), ("tpot_p95_ms", "p95"), ("tpot_p99_ms", "p99")])]
    return "\n".join(parts)


def write_png(data: dict, path: str, top: int = 8) -> str:
    """Tokens by model and top tenants; with ``over_time`` in the data, tokens per tenant (the top
    ``top``, the rest as "others") and TTFT/TPOT percentiles over the window too."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--png needs matplotlib, which is not installed (pip install matplotlib); no image written"
    over = data.get("over_time")
    fig, axes = plt.subplots(2 if over else 1, 2, figsize=(12, 8 if over else 4), squeeze=False)
    for ax, items, title in ((axes[0][0], [(m["model"], m["tokens"]) for m in data["by_model"]], "tokens by model"),
                             (axes[0][1], [(t["tenant_id"], t["tokens"]) for t in data["top_tenants"]],
                              "top tenants (tokens)")):
        ax.barh([k for k, _ in items][::-1], [v for _, v in items][::-1])
        ax.set_title(title)
    if over:
        _time_panels(axes[1][0], axes[1][1], over, top)
    fig.tight_layout()
    fig.savefig(path)
    return f"wrote {path}"


def _time_panels(tokens_ax, latency_ax, over: dict, top: int) -> None:
    from datetime import datetime, timezone

    import matplotlib.dates as mdates

    p = usage_panels(over["usage"], over["latency"], over["since_ms"], over["until_ms"], over["bucket_s"])
    times = [datetime.fromtimestamp(t / 1000, timezone.utc) for t in p["buckets"]]
    end = datetime.fromtimestamp(over["until_ms"] / 1000, timezone.utc)
    series = tenant_stack(p, top)
    if series:
        # the last bucket drawn to the window's end, not cut off at its start
        tokens_ax.stackplot(times + [end], *(v + v[-1:] for v in series.values()), labels=list(series),
                            step="post")
        tokens_ax.legend(loc="upper left", fontsize="small")
    tokens_ax.set_title(f"tokens per tenant (per {_width_label(p['bucket_s'])}, UTC)")
    for name, style in (("ttft_p50_ms", "-"), ("ttft_p99_ms", "--"), ("tpot_p50_ms", ":")):
        latency_ax.plot(times, [float("nan") if v is None else v for v in p["latency"][name]], style, marker=".",
                        label=name.replace("_ms", "").replace("_", " "))
    latency_ax.set_title("latency of finished requests (ms)")
    latency_ax.legend(loc="upper left", fontsize="small")
    for ax in (tokens_ax, latency_ax):
        ax.set_xlim(times[0], end)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax.xaxis.get_major_locator()))


def tenant_stack(panels: dict, top: int) -> dict[str, list[float]]:
    """Tokens per bucket of the ``top`` tenants by tokens, and of all the others summed as "others"."""
    ranked = [t["tenant_id"] for t in panels["top_tenants"]]
    series = {name: panels["tokens_by_tenant"][name] for name in ranked[:top]}
    rest = [sum(v) for v in zip(*(panels["tokens_by_tenant"][n] for n in ranked[top:]))]
    if rest:
        series["others"] = rest
    return series


def _width_label(seconds: int) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds % size == 0:
            n = seconds // size
            return unit if n == 1 else f"{n} {unit}s"
    return f"{seconds} s"


def summary(source, since: str | None = "24h", until: str | None = None, limit: int = 10,
            png: str | None = None) -> str:
    data = source.summary(analytics.parse_time(since), analytics.parse_time(until), limit)
    text = format_summary(data)
    if png:
        text += "\n\n" + write_png(data, png)
    return text


# --- reconcile ----------------------------------------------------------------------------
@dataclass
class ReconcileReport:
    streamed: dict[str, int] = field(default_factory=dict)   # request_id -> completion tokens sent
    billed: dict[str, int] = field(default_factory=dict)     # request_id -> completion tokens billed
    differences: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences


def streamed_tokens(since_ms: int | None, until_ms: int | None = None, bootstrap: str | None = None,
                    timeout_s: float = 30.0) -> dict[str, int]:
    """Completion tokens sent to clients per request, from `ReplyBatch` events on `replies` with a
    timestamp in the window. A token counts once per (request_id, choice_index, token index):
    batches re-sent after a worker retry cover the same indexes and add nothing."""
    from infra.kafka import topic_reader
    from schemas import codec, topics
    from schemas.records import ReplyBatch

    overrides: dict[str, Any] = {"bootstrap.servers": bootstrap} if bootstrap else {}
    seen: dict[str, set[tuple[int, int]]] = defaultdict(set)
    topic = topics.REPLIES.name
    parts = {(topic, p): 0 for p in topic_reader.partitions(topic, "usage-reconcile", **overrides)}
    # A read that runs out of time raises: differences computed from part of the stream would be false.
    for msg in topic_reader.read_to_end(parts, "usage-reconcile", timeout_s, since_ms=since_ms, **overrides):
        try:
            event = codec.decode(msg.value(), msg.headers())
        except codec.UndecodableEvent:
            continue
        if event.name != "ReplyBatch":
            continue
        batch = codec.record_of(event, ReplyBatch)
        ts = batch["timestamp_ms"]
        if (since_ms is not None and ts < since_ms) or (until_ms is not None and ts >= until_ms):
            continue
        for item in batch["items"]:
            positions = seen[item["request_id"]]
            first = item["first_token_index"]
            for i in range(len(item["token_ids"])):
                positions.add((item["choice_index"], first + i))
    return {rid: len(pos) for rid, pos in seen.items()}


def reconcile(source, since: str = "1h", until: str | None = None, bootstrap: str | None = None,
              streamed: dict[str, int] | None = None) -> ReconcileReport:
    """Compare completion tokens streamed to clients with completion tokens billed, per request."""
    since_ms = analytics.parse_time(since)
    until_ms = analytics.parse_time(until)
    if streamed is None:
        streamed = streamed_tokens(since_ms, until_ms, bootstrap)
    billed_rows = {r["request_id"]: r for r in source.lookup(sorted(streamed))}
    for r in source.requests_in_window(since_ms, until_ms):
        billed_rows.setdefault(r["request_id"], r)
    report = ReconcileReport(streamed=streamed,
                             billed={rid: (r["completion_tokens"] if r["billable"] else 0)
                                     for rid, r in billed_rows.items()})
    for rid in sorted(set(streamed) | set(report.billed)):
        s, b = streamed.get(rid), report.billed.get(rid)
        if s == b or (s is None and b == 0):
            continue
        problem = "not billed" if b is None else ("billed, nothing streamed" if s is None else "mismatch")
        report.differences.append({"request_id": rid, "streamed": s, "billed": b, "problem": problem,
                                   "tenant_id": billed_rows.get(rid, {}).get("tenant_id")})
    return report


def format_reconcile(report: ReconcileReport, limit: int = 50) -> str:
    head = (f"requests streamed: {len(report.streamed)}  billed: {len(report.billed)}  "
            f"tokens streamed: {sum(report.streamed.values()):,}  "
            f"billed: {sum(report.billed.values()):,}  differences: {len(report.differences)}")
    if report.ok:
        return head + "\nOK: every streamed completion token is billed, and nothing else is."
    return head + "\n" + _table(report.differences[:limit], [("request_id", "request"), ("tenant_id", "tenant"),
                                                              ("streamed", "streamed"), ("billed", "billed"),
                                                              ("problem", "problem")])


# --- argparse -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenmill usage", description="usage analytics and reconciliation")
    p.add_argument("--url", help="billing service URL (default $TOKENMILL_BILLING_URL or http://127.0.0.1:8090)")
    p.add_argument("--direct", action="store_true", help="open ClickHouse directly instead of the service")
    p.add_argument("--clickhouse-url", help="with --direct: chdb:///dir or http(s)://...")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary", help="tokens and cost by model, top tenants, latency")
    s.add_argument("--since", default="24h", help="24h, 7d, ISO date or epoch ms")
    s.add_argument("--until", default=None)
    s.add_argument("--limit", type=int, default=10)
    s.add_argument("--png", default=None, help="also draw the charts into this PNG (needs matplotlib)")
    s.add_argument("--json", action="store_true")
    r = sub.add_parser("reconcile", help="completion tokens streamed (replies topic) vs billed (ledger)")
    r.add_argument("--since", required=True)
    r.add_argument("--until", default=None)
    r.add_argument("--json", action="store_true")
    m = sub.add_parser("mtd", help="month-to-date tokens per tenant")
    m.add_argument("--tenant", default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    source = DirectSource(args.clickhouse_url) if args.direct else HttpSource(args.url)
    if args.cmd == "summary":
        if args.json:
            print(json.dumps(source.summary(analytics.parse_time(args.since), analytics.parse_time(args.until),
                                            args.limit), indent=2))
        else:
            print(summary(source, args.since, args.until, args.limit, args.png))
        return 0
    if args.cmd == "reconcile":
        report = reconcile(source, args.since, args.until)
        print(json.dumps(report.differences, indent=2) if args.json else format_reconcile(report))
        return 0 if report.ok else 1
    data = source.month_to_date(args.tenant)
    print(_table([{"tenant_id": t, **d} for t, d in data.items()],
                 [("tenant_id", "tenant"), ("tokens", "tokens"), ("requests", "requests"), ("cost_usd", "cost USD")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
