"""Valid batch lines -> `InferenceRequested` events on `requests`, priority `batch`."""
from __future__ import annotations

import threading
from typing import Any, Iterable

from confluent_kafka import Producer

from infra.kafka import clients as kafka_clients
from ingress.api.batches import ids
from ingress.api.batches.parse import PreparedLine
from ingress.serving.request_builder import inference_requested
from schemas import codec, topics


def build_request(line: PreparedLine, *, batch_id: str, tenant: dict[str, Any], api_key_id: str | None,
                  reply_partition: int, arrived_at_ms: int, deadline_ms: int) -> dict[str, Any]:
    """The event for one line; everything but the envelope and arrival time is a function of the file."""
    return inference_requested(
        request_id=ids.request_id(batch_id, line.custom_id), tenant=tenant, body=line.body, chat=line.chat,
        model=line.base_model or line.model, prompt_token_ids=line.prompt_token_ids, max_tokens=line.max_tokens,
        seed=ids.default_seed(batch_id, line.custom_id), priority="batch", arrived_at_ms=arrived_at_ms,
        deadline_ms=deadline_ms, reply_topic=topics.BATCH_RESULTS.name, reply_partition=reply_partition,
        api_key_id=api_key_id, batch_id=batch_id, custom_id=line.custom_id, adapter=line.adapter)


class PublishError(RuntimeError):
    pass


def publish(records: Iterable[dict[str, Any]], producer: Producer | None = None, timeout: float = 60.0,
            progress=None) -> int:
    """Produce every record to `requests` (key: tenant id) and wait for all acknowledgements."""
    own = producer is None
    producer = producer or Producer(kafka_clients.producer_config("batch-submit"))
    failures: list[str] = []
    lock = threading.Lock()
    delivered = 0

    def on_delivery(err, _msg):
        nonlocal delivered
        with lock:
            if err is not None:
                failures.append(str(err))
            else:
                delivered += 1

    sent = 0
    for record in records:
        kafka_clients.produce_event(producer, topics.REQUESTS.name, record["tenant_id"], "InferenceRequested",
                                    record, on_delivery=on_delivery)
        sent += 1
        if sent % 500 == 0:
            producer.poll(0)
            if progress:
                progress(sent)
    remaining = producer.flush(timeout)
    if remaining or failures or delivered != sent:
        raise PublishError(f"{sent - delivered} of {sent} requests were not acknowledged by Kafka"
                           + (f": {failures[0]}" if failures else ""))
    if own:
        producer.flush(1)
    return sent


def cancel_events(tenant_id: str, request_ids: Iterable[str], producer: Producer | None = None,
                  timeout: float = 30.0, reason: str = "batch_cancelled") -> int:
    """One `RequestCancelled` per request on `cancellations` (key: request id)."""
    producer = producer or Producer(kafka_clients.producer_config("batch-cancel"))
    count = 0
    for rid in request_ids:
        record = codec.new_event("RequestCancelled", request_id=rid, tenant_id=tenant_id, reason=reason)
        kafka_clients.produce_event(producer, topics.CANCELLATIONS.name, rid, "RequestCancelled", record)
        count += 1
    if producer.flush(timeout):
        raise PublishError("some cancellations were not acknowledged by Kafka")
    return count
