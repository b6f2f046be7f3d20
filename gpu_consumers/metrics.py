"""Prometheus metrics of a GPU worker (names follow vLLM's, with a `tokenmill:` prefix)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from infra.metric_buckets import LATENCY_BUCKETS, TOKEN_BUCKETS
from infra.config import metrics_host


class WorkerMetrics:
    def __init__(self, worker_id: str, model: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"worker": worker_id, "model": model}
        names = list(labels)
        self.running = Gauge("tokenmill:num_requests_running", "Sequences in the running batch", names,
                             registry=r).labels(**labels)
        self.waiting = Gauge("tokenmill:num_requests_waiting", "Sequences waiting for a slot or KV blocks", names,
                             registry=r).labels(**labels)
        self.kv_usage = Gauge("tokenmill:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", names,
                              registry=r).labels(**labels)
        self.prefix_queries = Counter("tokenmill:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache",
                                      names, registry=r).labels(**labels)
        self.prefix_hits = Counter("tokenmill:prefix_cache_hits_total", "Prompt tokens served from the prefix cache",
                                   names, registry=r).labels(**labels)
        # reason: memory (the engine ran out of KV blocks), fairness or priority (streams asked)
        self._preemptions = Counter("tokenmill:num_preemptions_total", "Sequences preempted, by reason",
                                    names + ["reason"], registry=r)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens_total", "Prompt tokens of ended requests", names,
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("tokenmill:generation_tokens_total", "Generated tokens", names,
                                         registry=r).labels(**labels)
        self.queue_time = Histogram("tokenmill:request_queue_time_seconds", "Arrival at ingress to start on this worker",
                                    names, buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        self.tpot = Histogram("tokenmill:time_per_output_token_seconds", "Mean time per output token after the first",
                              names, buckets=TOKEN_BUCKETS, registry=r).labels(**labels)
        self.step_time = Histogram("tokenmill:engine_step_seconds", "Wall time of one engine step", names,
                                   buckets=TOKEN_BUCKETS, registry=r).labels(**labels)
        self.outcomes = Counter("tokenmill:request_outcomes_total", "Requests ended, by status", names + ["status"],
                                registry=r)
        self._labels = labels
        self.memory_preemptions = self._preemptions.labels(**labels, reason="memory")
        self._seen = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "preemptions": 0}

    def serve(self, port: int) -> None:
        start_http_server(port, addr=metrics_host(), registry=self.registry)

    def preempted(self, reason: str) -> None:
        self._preemptions.labels(**self._labels, reason=reason).inc()

    def outcome(self, status: str) -> None:
        self.outcomes.labels(**self._labels, status=status).inc()

    def update_from_engine(self, stats: dict, pending: int) -> None:
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0) + pending)
        self.kv_usage.set(stats.get("kv_usage", 0.0))
        for key, counter in (("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
                             ("preemptions", self.memory_preemptions)):
            value = stats.get(key, 0)
            if value > self._seen[key]:
                counter.inc(value - self._seen[key])
                self._seen[key] = value
