"""Helpers to make and produce RequestCompleted events in billing tests."""
from __future__ import annotations

import time

from confluent_kafka import Producer

from infra.kafka import clients as kafka_clients
from schemas import codec, topics


def completed(request_id: str, tenant: str, model: str = "m-small", *, status: str = "finished", prompt: int = 10,
              completion: int = 5, cached: int = 0, finished_at_ms: int | None = None, ttft: float | None = 20.0,
              tpot: float | None = 5.0, started: bool | None = None, adapter: str | None = None) -> dict:
    """A RequestCompleted; a shed one with no completion token never started (so is not billed),
    as streams writes it, unless ``started`` says otherwise."""
    now = finished_at_ms if finished_at_ms is not None else int(time.time() * 1000)
    if started is None:
        started = not (status == "shed" and completion == 0)
    return codec.new_event(
        "RequestCompleted", request_id=request_id, tenant_id=tenant, model=model, status=status,
        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached, arrived_at_ms=now - 500,
        started_at_ms=now - 400 if started else None, first_token_at_ms=now - 300, finished_at_ms=now, ttft_ms=ttft, tpot_ms=tpot,
        queue_ms=100.0, worker_id="w0", adapter=adapter)


def produce_completed(producer: Producer, records: list[dict], topic: str = topics.USAGE.name) -> None:
    for r in records:
        kafka_clients.produce_event(producer, topic, r["tenant_id"], "RequestCompleted", r)
    assert producer.flush(15) == 0
