"""The worker's capacity adverts (CapacityAdvertised on `capacity`): free slots and KV blocks, the
`work` partitions it reads, its prefix-cache summary and resident adapters. Sent when free capacity
changed, a summary is due, or a second passed; at once when forced (an assignment, a preemption)."""
from __future__ import annotations

import time
from typing import Any

from gpu_consumers.adapter_cache import AdapterCache
from gpu_consumers.in_flight import RequestBook
from gpu_consumers.metrics import WorkerMetrics
from gpu_consumers.prefix_summary import PrefixSummary
from infra.kafka import clients as kafka_clients
from schemas import codec, topics

ADVERTISE_INTERVAL_S = 1.0


class Adverts:
    """`partitions` says whether this worker reads `work` yet (`.assigned`) and which partitions
    (`.numbers`); `intake` how many requests it took in (`.consumed_total`)."""

    def __init__(self, worker_id: str, incarnation: str, model_name: str, engine: Any, book: RequestBook, *,
                 producer: Any, metrics: WorkerMetrics, adapters: AdapterCache, partitions: Any, intake: Any):
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.model_name = model_name
        self.engine = engine
        self.book = book
        self.producer = producer
        self.metrics = metrics
        self.adapters = adapters
        self.partitions = partitions
        self.intake = intake
        self.prefix_summary = PrefixSummary(engine)
        self._last_advert = 0.0
        self._last_free: tuple[int, int] | None = None

    def assigned(self) -> None:
        """A new assignment: a new gate may listen, so the whole prefix summary goes with the advert."""
        self.prefix_summary.resend()
        self.advertise(force=True)

    def advertise(self, force: bool = False, stopping: bool = False) -> None:
        if not self.partitions.assigned and not stopping:
            return
        free = (self.engine.num_free_slots() - len(self.book.pending), self.engine.num_free_blocks())
        now = time.monotonic()
        if (not force and free == self._last_free and now - self._last_advert < ADVERTISE_INTERVAL_S
                and not self.prefix_summary.due(now)):
            return
        self._last_free = free
        self._last_advert = now
        self.adapters.sweep_disk()  # files of versions taken down since (a directory listing when any was)
        stats = self.engine.stats
        self.metrics.update_from_engine(stats, len(self.book.pending))
        record = codec.new_event(
            "CapacityAdvertised", worker_id=self.worker_id, incarnation=self.incarnation, model=self.model_name,
            free_slots=max(0, free[0]), free_kv_blocks=free[1], total_slots=self.engine.max_num_seqs,
            total_kv_blocks=self.engine.num_total_blocks, block_size=self.engine.block_size,
            running=int(stats.get("running", 0)), waiting=int(stats.get("waiting", 0)) + len(self.book.pending),
            consumed_total=self.intake.consumed_total, stopping=stopping,
            work_partitions=sorted(self.partitions.numbers) if not stopping else [],
            cached_blocks=self.prefix_summary.take(now),
            resident_adapters=list(getattr(self.engine, "resident_adapters", list)()),
        )
        kafka_clients.produce_event(self.producer, topics.CAPACITY.name, self.worker_id, "CapacityAdvertised", record)
