"""The one declaration of every Kafka topic tokenmill uses.

Partition counts are sized so several processes of each part can share the load;
`replies` partitions bound how many ingress processes can run at once (one each).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    compacted: bool = False
    retention_ms: int = 7 * DAY_MS
    extra: dict[str, str] = field(default_factory=dict)

    def config(self) -> dict[str, str]:
        cfg = {"cleanup.policy": "compact" if self.compacted else "delete"}
        if not self.compacted:
            cfg["retention.ms"] = str(self.retention_ms)
        cfg.update(self.extra)
        return cfg


TENANTS = TopicSpec("tenants", 6, compacted=True)
REQUESTS = TopicSpec("requests", 12)
WORK = TopicSpec("work", 12)
CAPACITY = TopicSpec("capacity", 6, retention_ms=3600 * 1000)
REPLIES = TopicSpec("replies", 16, retention_ms=DAY_MS)
CANCELLATIONS = TopicSpec("cancellations", 6, retention_ms=DAY_MS)
# streams -> workers: PreemptRequested (every worker reads every partition, like `cancellations`).
PREEMPTIONS = TopicSpec("preemptions", 3, retention_ms=DAY_MS)
USAGE = TopicSpec("usage", 12, retention_ms=30 * DAY_MS)
QUOTA_STATE = TopicSpec("quota-state", 6, compacted=True)
INGRESS_HEARTBEATS = TopicSpec("ingress-heartbeats", 3, compacted=True)
DEAD_LETTERS = TopicSpec("dead-letters", 3, retention_ms=30 * DAY_MS)
# Reply address of offline batch requests (ReplyBatch, RequestError); partition = hash(batch id).
BATCH_RESULTS = TopicSpec("batch-results", 6, retention_ms=7 * DAY_MS)
# Stored Responses API responses (StoredResponse, key = response id): every ingress follows it. Compacted
# (the newest record per id) and expiring: a stored response is kept 30 days, as on OpenAI's API.
RESPONSES_RETENTION_MS = 30 * DAY_MS
RESPONSES = TopicSpec("responses", 6, compacted=True,
                      extra={"cleanup.policy": "compact,delete", "retention.ms": str(RESPONSES_RETENTION_MS)})

# Registered LoRA adapters (docs/lora.md, "Registry, API and billing"): an AdapterManifest keyed
# <tenant>/<name> and the AdapterChunk records of its safetensors file, all in the partition of that key,
# chunks first. Compacted, kept for ever: a worker on any host rebuilds every adapter from it. A message
# holds one chunk of at most ADAPTER_CHUNK_BYTES (below the broker's default 1 MB message limit).
ADAPTERS = TopicSpec("adapters", 3, compacted=True)
ADAPTER_CHUNK_BYTES = 512 * 1024

ALL_TOPICS: tuple[TopicSpec, ...] = (
    TENANTS, REQUESTS, WORK, CAPACITY, REPLIES, CANCELLATIONS, PREEMPTIONS, USAGE, QUOTA_STATE, DEAD_LETTERS, INGRESS_HEARTBEATS,
    BATCH_RESULTS, RESPONSES, ADAPTERS,
)
