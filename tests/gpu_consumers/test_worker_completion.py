"""What a worker bills for a request that ends before it runs there (cancelled or shed while waiting
to start): a resumed, preempted request still counts the tokens its client already got."""
from __future__ import annotations

from gpu_consumers.metrics import WorkerMetrics
from gpu_consumers.recorded_usage import RecordedUsage
from gpu_consumers.worker import GpuWorker
from tests.streams.test_streams_gate import request


def completed_events(record: dict, status: str) -> list[dict]:
    worker = GpuWorker.__new__(GpuWorker)  # the usage event alone: no engine, no Kafka clients
    worker.worker_id, worker.metrics = "completion-test", WorkerMetrics("completion-test", "m")
    worker.recorded_usage = RecordedUsage(read=lambda since_ms: set())
    sent: list[dict] = []
    worker._produce = lambda topic, key, name, rec, partition=None, on_delivery=None: sent.append(rec)
    worker._complete(record, status, finish_reason=status)
    return sent


def test_a_resumed_request_cancelled_before_it_restarts_is_billed_for_what_it_streamed():
    record = dict(request("a", max_tokens=64), resume={
        "completion_token_ids": list(range(28)), "text_chars": 90, "started_at_ms": 1_000,
        "first_token_at_ms": 1_200, "cached_tokens": 16})
    (usage,) = completed_events(record, "cancelled")
    assert usage["status"] == "cancelled"
    assert usage["completion_tokens"] == 28 and usage["cached_tokens"] == 16
    assert usage["started_at_ms"] == 1_000 and usage["first_token_at_ms"] == 1_200


def test_a_fresh_request_that_never_ran_is_billed_no_completion():
    (usage,) = completed_events(request("a"), "shed")
    assert usage["completion_tokens"] == 0 and usage["first_token_at_ms"] is None
