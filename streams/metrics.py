"""Prometheus metrics of the queue in front of the pool (names prefixed ``tokenmill:``).

Served on ``TOKENMILL_STREAMS_METRICS_PORT`` (default 9102; 0 = off) by the active
instance and the standby alike (the standby reports ``tokenmill:streams_active 0``
and no queue). ``tokenmill queue`` (streams/queue_view.py) reads this endpoint.
"""
from __future__ import annotations

import logging
import time

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from infra.metric_buckets import LATENCY_BUCKETS
from schedulers.fairness_index import jain_index, max_service_difference
from infra.config import metrics_host

log = logging.getLogger("tokenmill.streams.metrics")

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
HOP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class StreamsMetrics:
    def __init__(self) -> None:
        self.active = Gauge("tokenmill:streams_active", "1 while this instance owns the queue")
        self.depth = Gauge("tokenmill:queue_depth", "Requests waiting in streams", ["tenant", "priority"])
        self.credits = Gauge("tokenmill:queue_credits", "Release credits available now", ["model"])
        self.in_transit = Gauge("tokenmill:queue_in_transit", "Released, not yet taken in by a worker", ["model"])
        self.in_flight = Gauge("tokenmill:queue_released_in_flight", "Released requests not yet ended")
        self.wait = Histogram("tokenmill:queue_wait_seconds", "Time from enqueue to release", ["priority"],
                              buckets=WAIT_BUCKETS)
        self.hop = Histogram("tokenmill:streams_hop_seconds",
                             "From the InferenceRequested timestamp to its release (includes queueing)",
                             buckets=HOP_BUCKETS)
        self.admitted_total = Counter("tokenmill:queue_admitted", "Requests admitted and queued",
                                      ["tenant", "priority"])
        self.released_total = Counter("tokenmill:queue_released", "Requests released to work",
                                      ["tenant", "priority"])
        self.shed_total = Counter("tokenmill:queue_shed", "Requests shed before release", ["tenant", "reason"])
        self.rejected_total = Counter("tokenmill:queue_rejected", "Requests rejected by streams",
                                      ["tenant", "code"])
        self.cancelled_total = Counter("tokenmill:queue_cancelled", "Requests cancelled while queued", ["tenant"])
        self.preemptions_total = Counter("tokenmill:queue_preemptions", "Running sequences preempted by streams",
                                         ["tenant", "reason"])
        self.placements_total = Counter(
            "tokenmill:placements", "Released requests by the worker they were addressed to and why (prefix: it "
            "holds leading prompt blocks; adapter: it holds the request's LoRA adapter; load: most free slots; full: no worker had a free slot; by-key: not "
            "placed, the model has fewer than two workers that report their partitions)", ["model", "worker", "reason"])
        self.adapter_loads_total = Counter(
            "tokenmill:placement_adapter_loads", "Requests with a LoRA adapter placed on a worker that neither "
            "held it nor was expected to (it loads the adapter)", ["model", "worker"])
        self.running = Gauge("tokenmill:queue_running", "Released requests not yet ended (slots held)", ["tenant"])
        self.ttft = Histogram("tokenmill:tenant_time_to_first_token_seconds", "Arrival to first token, per tenant",
                              ["tenant"], buckets=LATENCY_BUCKETS)
        self.jain = Gauge("tokenmill:fairness_jain_index",
                          "Jain's index over per-tenant weighted service in the last minute (1 = equal)")
        self.max_difference = Gauge("tokenmill:fairness_max_service_difference",
                                    "Largest weighted-service gap between backlogged tenants in the last minute")
        # metric.labels(...) hashes and checks its arguments on every call; the gate calls these
        # hooks for every request, so each labelled child is looked up once.
        self._children: dict[tuple, object] = {}
        self._depth_labels: set[tuple[str, str]] = set()
        self._running_labels: set[str] = set()
        self._models: set[str] = set()
        self._last_observe = 0.0

    def _child(self, metric, *labels: str):
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # hooks called by the gate
    def admitted(self, tenant: str, priority: str) -> None:
        self._child(self.admitted_total, tenant, priority).inc()

    def released(self, tenant: str, priority: str, wait_s: float, hop_s: float) -> None:
        self._child(self.released_total, tenant, priority).inc()
        self._child(self.wait, priority).observe(wait_s)
        self.hop.observe(hop_s)

    def placed(self, model: str, worker: str | None, reason: str, loads_adapter: bool = False) -> None:
        self._child(self.placements_total, model, worker or "", reason).inc()
        if loads_adapter:
            self._child(self.adapter_loads_total, model, worker or "").inc()

    def shed(self, tenant: str, reason: str) -> None:
        self._child(self.shed_total, tenant, reason).inc()

    def rejected(self, tenant: str, code: str) -> None:
        self._child(self.rejected_total, tenant, code).inc()

    def cancelled(self, tenant: str) -> None:
        self._child(self.cancelled_total, tenant).inc()

    def preempted(self, tenant: str, reason: str) -> None:
        self._child(self.preemptions_total, tenant, reason).inc()

    def tenant_ttft(self, tenant: str, seconds: float) -> None:
        self._child(self.ttft, tenant).observe(seconds)

    def observe_gate(self, gate, now: float, force: bool = False) -> None:
        if not force and now - self._last_observe < 0.25:
            return
        self._last_observe = now
        seen = set()
        for tenant, classes in gate.queue.depths().items():
            for priority, n in classes.items():
                self._child(self.depth, tenant, priority).set(n)
                seen.add((tenant, priority))
        for labels in self._depth_labels - seen:
            self._child(self.depth, *labels).set(0)
        self._depth_labels |= seen
        available = gate.credits.available(now)
        for model in gate.credits.models() | self._models:
            self.credits.labels(model).set(available.get(model, 0))
            self.in_transit.labels(model).set(gate.credits.in_transit(model))
        self._models |= gate.credits.models()
        self.in_flight.set(len(gate.released))
        running: dict[str, int] = {}
        for info in gate.released.values():
            running[info["tenant"]] = running.get(info["tenant"], 0) + 1
        for tenant in self._running_labels | set(running):
            self._child(self.running, tenant).set(running.get(tenant, 0))
        self._running_labels |= set(running)
        service = gate.service.totals(now)
        index = jain_index(list(service.values()))
        self.jain.set(index if index is not None else 1.0)
        gap = max_service_difference(service, set(running) | set(gate.queue.depths()))
        self.max_difference.set(gap or 0.0)

    def set_active(self, active: bool) -> None:
        self.active.set(1 if active else 0)
        if not active:
            for labels in self._depth_labels:
                self.depth.labels(*labels).set(0)


_started: set[int] = set()


def serve(port: int) -> bool:
    if port <= 0 or port in _started:
        return False
    try:
        start_http_server(port, addr=metrics_host())
    except OSError as exc:
        log.warning("metrics endpoint on port %s not started: %s", port, exc)
        return False
    _started.add(port)
    log.info("metrics on http://%s:%s/metrics", metrics_host(), port)
    return True


def now() -> float:
    return time.time()
