"""The dashboard's live panel: the queue, the workers and the refusals, read from their /metrics.

The ledger knows only what was accepted; what waits now, what runs where and what was refused at
the door lives in the processes' Prometheus counters. The billing service reads them on the
browser's behalf (one origin for the page, and the metrics ports stay on loopback):

* streams (the gate): ``TOKENMILL_STREAMS_METRICS_URL``, else port ``TOKENMILL_STREAMS_METRICS_PORT``
  (9102) on loopback: per tenant queued, running, released, shed, rejected, preempted; credits.
* workers: ``TOKENMILL_WORKER_METRICS_URLS`` (comma-separated; default the `make up` worker's
  ``http://127.0.0.1:9101/metrics``): running batch, waiting, KV-cache use, preemptions.
* ingress: ``TOKENMILL_INGRESS_METRICS_URL``, else its admin listener: requests refused by status
  and code (they never reach the ledger: a refused request is never billed).

Counters are totals since each process started. A source that does not answer is reported with
its error, and the rest of the panel is still drawn.
"""
from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from infra.config import admin_listener
from infra.queue_metrics import fetch, summarize
from infra import settings


@dataclass
class LiveSources:
    streams_url: str | None
    worker_urls: list[str] = field(default_factory=list)
    ingress_url: str | None = None

    @classmethod
    def from_env(cls) -> LiveSources:
        streams = settings.STREAMS_METRICS_URL.get() or \
            f"http://127.0.0.1:{settings.STREAMS_METRICS_PORT.get()}/metrics"
        workers = settings.WORKER_METRICS_URLS.get()
        host, port = admin_listener(settings.PORT.get())
        ingress = settings.INGRESS_METRICS_URL.get() or f"http://{host}:{port}/metrics"
        return cls(streams, [u.strip() for u in workers.split(",") if u.strip()], ingress)


def queue_panel(text: str) -> dict:
    """The gate's queue per tenant (all classes together) and its credits per model."""
    s = summarize(text)
    tenants: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (tenant, _priority), row in s["rows"].items():
        for k, v in row.items():
            tenants[tenant][k] += v
    for tenant, t in s["tenants"].items():
        for k, v in t.items():
            tenants[tenant][k] += v
    waits = {prio: {"p50_s": w[0.5], "p99_s": w[0.99]} for prio, w in s["waits"].items()}
    return {"active": s["active"], "in_flight": s["in_flight"], "fairness": s["fairness"], "waits": waits,
            "models": {m: dict(v) for m, v in s["models"].items()},
            "tenants": [{"tenant_id": t, **{k: v for k, v in row.items()}} for t, row in sorted(tenants.items())]}


_WORKER_GAUGES = {"tokenmill:num_requests_running": "running", "tokenmill:num_requests_waiting": "waiting",
                  "tokenmill:kv_cache_usage_perc": "kv_usage"}


def worker_panel(text: str) -> list[dict]:
    """One row per worker (a process may report several): batch size, waiting, KV use, preemptions."""
    workers: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.labels.get("worker", ""), s.labels.get("model", ""))
            if s.name in _WORKER_GAUGES:
                workers[key][_WORKER_GAUGES[s.name]] = s.value
            elif s.name == "tokenmill:num_preemptions_total":
                workers[key]["preemptions"] += s.value
            elif s.name == "tokenmill:prefix_cache_queries_total":
                workers[key]["prefix_queries"] += s.value
            elif s.name == "tokenmill:prefix_cache_hits_total":
                workers[key]["prefix_hits"] += s.value
    return [{"worker": w, "model": m, **row} for (w, m), row in sorted(workers.items())]


def rejections_panel(text: str) -> list[dict]:
    """Requests ingress refused, by HTTP status and error code."""
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tokenmill:request_rejections_total" and s.value:
                out.append({"status": s.labels.get("status", ""), "code": s.labels.get("code", ""), "count": s.value})
    return sorted(out, key=lambda r: (-r["count"], r["status"], r["code"]))


def live_panel(sources: LiveSources, read: Callable[[str], str] = fetch) -> dict:
    """Everything the live panel draws; ``errors`` names each source that did not answer."""
    jobs: list[tuple[str, str, Callable]] = []
    if sources.streams_url:
        jobs.append(("queue", sources.streams_url, queue_panel))
    jobs += [("workers", url, worker_panel) for url in sources.worker_urls]
    if sources.ingress_url:
        jobs.append(("rejections", sources.ingress_url, rejections_panel))

    def run(job):
        name, url, parse = job
        try:
            return name, url, parse(read(url)), None
        except Exception as exc:  # noqa: BLE001 - a source that is down or garbled is shown, not fatal
            return name, url, None, f"{url}: {type(exc).__name__}: {exc}"

    out: dict = {"queue": None, "workers": [], "rejections": [], "errors": []}
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(jobs)))) as pool:
        for name, _url, value, error in pool.map(run, jobs):
            if error:
                out["errors"].append(error)
            elif name == "workers":
                out["workers"] += value
            else:
                out[name] = value
    return out
