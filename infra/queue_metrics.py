"""The streams gate's Prometheus text, read back as one summary of its queue.

What `tokenmill queue` prints and what the billing dashboard's live panel draws: per tenant and
class, requests queued, released, shed and rejected; per tenant, the slots it holds and the
preemptions streams asked of it; credits per model; the fairness index; queue-wait percentiles.
"""
from __future__ import annotations

import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families


def fetch(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def summarize(text: str) -> dict:
    rows: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    models: dict[str, dict[str, float]] = defaultdict(dict)
    wait_buckets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    active = None
    in_flight = 0.0
    tenants: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    fairness: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, s.value
            if name == "tokenmill:streams_active":
                active = bool(value)
            elif name == "tokenmill:queue_depth":
                rows[(labels["tenant"], labels["priority"])]["queued"] += value
            elif name == "tokenmill:queue_released_total":
                rows[(labels["tenant"], labels["priority"])]["released"] += value
            elif name == "tokenmill:queue_shed_total":
                rows[(labels["tenant"], "*")]["shed"] += value
            elif name == "tokenmill:queue_rejected_total":
                rows[(labels["tenant"], "*")]["rejected"] += value
            elif name == "tokenmill:queue_credits":
                models[labels["model"]]["credits"] = value
            elif name == "tokenmill:queue_in_transit":
                models[labels["model"]]["in_transit"] = value
            elif name == "tokenmill:queue_released_in_flight":
                in_flight = value
            elif name == "tokenmill:queue_running":
                tenants[labels["tenant"]]["running"] = value
            elif name == "tokenmill:queue_preemptions_total":
                tenants[labels["tenant"]][f"preempted_{labels['reason']}"] += value
            elif name == "tokenmill:fairness_jain_index":
                fairness["jain"] = value
            elif name == "tokenmill:fairness_max_service_difference":
                fairness["max_difference"] = value
            elif name == "tokenmill:queue_wait_seconds_bucket":
                wait_buckets[labels["priority"]].append((float(labels["le"]), value))
    waits = {p: {q: _quantile(b, q) for q in (0.5, 0.99)} for p, b in wait_buckets.items()}
    return {"active": active, "rows": rows, "models": models, "waits": waits, "in_flight": in_flight,
            "tenants": tenants, "fairness": fairness}


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    for le, count in buckets:
        if count >= q * total:
            return le
    return buckets[-1][0]
