"""A worker's parts wired as GpuWorker wires them, around a fake engine and producer: intake,
replies, control and the step, without any Kafka client."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from gpu_consumers.after_delivery import OffsetSettlements
from gpu_consumers.control import Control
from gpu_consumers.engine_step import EngineStep
from gpu_consumers.grammar_constraints import GrammarConstraints
from gpu_consumers.in_flight import RequestBook
from gpu_consumers.intake import Intake
from gpu_consumers.metrics import WorkerMetrics
from gpu_consumers.offset_tracker import OffsetTracker
from gpu_consumers.recorded_usage import RecordedUsage
from gpu_consumers.replies import Replies


@dataclass
class Parts:
    engine: Any
    producer: Any
    book: RequestBook
    offsets: OffsetTracker
    settlements: OffsetSettlements
    replies: Replies
    intake: Intake
    control: Control
    steps: EngineStep


def parts_without_kafka(model: str, engine: Any, producer: Any = None,
                        recorded_usage: RecordedUsage | None = None) -> Parts:
    worker_id = "parts-test"
    metrics = WorkerMetrics(worker_id, model)
    book, offsets = RequestBook(), OffsetTracker()
    settlements = OffsetSettlements(offsets)
    recorded_usage = recorded_usage or RecordedUsage(read=lambda since_ms: set())
    readers = SimpleNamespace(gone=lambda record: False)
    adapters = SimpleNamespace(lora_for=lambda record: None, forget=lambda request_id: None)
    replies = Replies(producer, worker_id, metrics, recorded_usage, settlements.settle)
    intake = Intake(model, worker_id, engine, book, producer=producer, offsets=offsets,
                    recorded_usage=recorded_usage, readers=readers, constraints=GrammarConstraints(engine),
                    adapters=adapters, replies=replies, metrics=metrics)  # type: ignore[arg-type]
    control = Control(worker_id, model, "i1", engine, book, producer=producer, offsets=offsets, replies=replies,
                      readers=readers, metrics=metrics, announce=lambda: None)
    steps = EngineStep(engine, book, replies, metrics, worker_id)
    return Parts(engine, producer, book, offsets, settlements, replies, intake, control, steps)
