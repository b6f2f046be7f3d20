"""Prometheus metrics of an ingress process (names follow vLLM's, with a `tokenmill:` prefix)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from infra.metric_buckets import LATENCY_BUCKETS, TOKEN_BUCKETS


class IngressMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds", "Arrival at ingress to first token sent",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds", "Gap between consecutive token deliveries",
                             ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds", "Arrival at ingress to last token sent",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("tokenmill:request_success_total", "Requests that ended, by finish reason",
                                ["model", "finished_reason"], registry=r)
        self.rejections = Counter("tokenmill:request_rejections_total", "Requests refused, by status and code",
                                  ["status", "code"], registry=r)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens_total", "Prompt tokens of finished requests",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("tokenmill:generation_tokens_total", "Tokens streamed to clients",
                                         ["model"], registry=r)
        self.cancellations = Counter("tokenmill:request_cancellations_total", "Clients that went away mid-request",
                                     ["model"], registry=r)
