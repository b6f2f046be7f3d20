"""What a worker sends back for a request: its tokens (ReplyBatch items), its error (RequestError)
and its usage (RequestCompleted, the ledger's one record of it).

Each event that ends a request is produced with a delivery callback from the request's settle
(after_delivery.py): its `work` offset is done only once the broker has them all.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from gpu_consumers.after_delivery import AfterDelivery
from gpu_consumers.engine.core.sequence import KV_CACHE_FULL
from gpu_consumers.in_flight import InFlight, now_ms, request_id_of, resume_of
from gpu_consumers.metrics import WorkerMetrics
from gpu_consumers.recorded_usage import RecordedUsage
from infra.kafka import clients as kafka_clients
from schemas import codec, topics
from schemas.records import InferenceRequested

log = logging.getLogger("tokenmill.worker")

# (HTTP status, error type, code, message, retry-after seconds) of a request refused before it ran
Refusal = tuple[int, str, str, str, float | None]
Settle = Callable[[str, int, int], AfterDelivery]


class Replies:
    def __init__(self, producer: Any, worker_id: str, metrics: WorkerMetrics, recorded_usage: RecordedUsage,
                 settle: Settle):
        self.producer = producer
        self.worker_id = worker_id
        self.metrics = metrics
        self.recorded_usage = recorded_usage
        self.settle = settle

    def produce(self, topic: str, key: Any, name: str, record: dict, partition: int | None = None,
                on_delivery: Callable | None = None) -> None:
        kafka_clients.produce_event(self.producer, topic, key, name, record, partition=partition,
                                    on_delivery=on_delivery)

    def error_reply(self, record: InferenceRequested, status: int, error_type: str, code: str, message: str,
                    retry_after: float | None = None, settle: AfterDelivery | None = None) -> None:
        err = codec.new_event("RequestError", request_id=record["request_id"], status_code=status,
                              error_type=error_type, code=code, message=message, retry_after_s=retry_after)
        self.produce(record["reply_topic"], record["request_id"], "RequestError", err,
                     partition=record["reply_partition"], on_delivery=settle.expect() if settle else None)

    def complete(self, record: InferenceRequested, status: str, *, flight: InFlight | None = None,
                 finish_reason: str | None = None, settle: AfterDelivery | None = None) -> None:
        """The request's usage event (unless its previous owner's stands) and its metrics."""
        usage, tpot = usage_event(record, status, self.worker_id, flight, finish_reason)
        if self.recorded_usage.already_recorded(request_id_of(record)):
            log.info("request %s ran again after its partition changed owner; its previous owner's "
                     "RequestCompleted stands", record["request_id"])
        else:
            self.produce(topics.USAGE.name, record["tenant_id"], "RequestCompleted", usage,
                         on_delivery=settle.expect() if settle else None)
        self.metrics.outcome(status)
        self.metrics.prompt_tokens.inc(len(record["prompt_token_ids"]))
        self.metrics.generation_tokens.inc(usage["completion_tokens"])
        if tpot is not None:
            self.metrics.tpot.observe(tpot / 1000)

    def fail(self, flight: InFlight, status: int, code: str, message: str) -> None:
        """End a request that ran with a server error: its reply, its usage (billed as far as it got)."""
        settle = self.settle(flight.request_id, flight.partition, flight.offset)
        self.error_reply(flight.record, status, "server_error", code, message, settle=settle)
        self.complete(flight.record, "failed", flight=flight, finish_reason="error", settle=settle)
        settle.seal()

    def end_cancelled(self, flight: InFlight) -> None:
        settle = self.settle(flight.request_id, flight.partition, flight.offset)
        self.complete(flight.record, "cancelled", flight=flight, finish_reason="cancelled", settle=settle)
        settle.seal()

    def end_unstarted(self, record: InferenceRequested, partition: int, offset: int, status: str,
                      finish_reason: str, error: Refusal | None = None) -> bool:
        """End a request that never ran: its error reply if any, its usage, and its offset done."""
        settle = self.settle(request_id_of(record), partition, offset)
        if error is not None:
            status_code, error_type, code, message, retry_after = error
            self.error_reply(record, status_code, error_type, code, message, retry_after=retry_after,
                             settle=settle)
        self.complete(record, status, finish_reason=finish_reason, settle=settle)
        settle.seal()
        return True

    def finished(self, flight: InFlight, settle: AfterDelivery) -> None:
        """Bill a request that ended; its offset is done once its last ReplyBatch (already produced,
        waiting on `settle`) and its usage are delivered."""
        self.complete(flight.record, "finished", flight=flight, finish_reason=flight.finish_reasons.get(0),
                      settle=settle)
        settle.seal()


def usage_event(record: InferenceRequested, status: str, worker_id: str, flight: InFlight | None,
                finish_reason: str | None) -> tuple[dict, float | None]:
    """The RequestCompleted of a request as it ends now, and its time per output token (ms) if any."""
    finished = now_ms()
    # Ended before it ran here: a resumed (preempted) request still counts what it streamed before.
    resume = resume_of(record)
    completion = sum(flight.completion_tokens.values()) if flight else len(resume.get("completion_token_ids") or [])
    first = flight.first_token_at_ms if flight else resume.get("first_token_at_ms")
    started = flight.started_at_ms if flight else resume.get("started_at_ms")
    cached = flight.cached_tokens if flight else int(resume.get("cached_tokens") or 0)
    tpot = None
    if first is not None and completion > record["sampling"]["n"]:
        tpot = (finished - first) / max(1, completion / record["sampling"]["n"] - 1)
    usage = codec.new_event(
        "RequestCompleted", request_id=record["request_id"], tenant_id=record["tenant_id"],
        model=record["model"], status=status, finish_reason=finish_reason, priority=record["priority"],
        prompt_tokens=len(record["prompt_token_ids"]), completion_tokens=completion,
        cached_tokens=cached, reserved_tokens=record["reserved_tokens"],
        arrived_at_ms=record["arrived_at_ms"], started_at_ms=started, first_token_at_ms=first,
        finished_at_ms=finished, ttft_ms=(first - record["arrived_at_ms"]) if first else None, tpot_ms=tpot,
        queue_ms=(started - record["arrived_at_ms"]) if started else None, worker_id=worker_id,
        api_key_id=record["api_key_id"], batch_id=record["batch_id"],
        adapter=adapter.get("name") if (adapter := record.get("adapter")) else None,
    )
    return usage, tpot


def reply_item(flight: InFlight, out: Any, stamp: int) -> dict:
    """What one step produced for one choice, as a ReplyBatch item; the flight's tallies follow."""
    if out.new_token_ids and flight.first_token_at_ms is None:
        flight.first_token_at_ms = stamp
    flight.completion_tokens[out.choice_index] = out.completion_tokens
    flight.cached_tokens = max(flight.cached_tokens, out.cached_tokens)
    if out.choice_index == 0:
        flight.text_chars += len(out.text_delta)
    item = {
        "request_id": out.request_id, "choice_index": out.choice_index,
        "first_token_index": out.first_token_index, "token_ids": list(out.new_token_ids),
        "text": out.text_delta, "logprobs": sampled_logprobs(out.new_token_ids, out.logprobs),
        # Clients get OpenAI's reasons; the ledger keeps the distinct one (RequestCompleted).
        "finish_reason": (("length" if out.finish_reason == KV_CACHE_FULL else out.finish_reason)
                          if out.finished else None), "usage": None,
    }
    if out.finished:
        flight.finished_choices.add(out.choice_index)
        flight.finish_reasons[out.choice_index] = out.finish_reason
        item["usage"] = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                         "cached_tokens": out.cached_tokens}
    return item


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float] | None:
    """The logprob of each sampled token; the engine gives one {token_id: logprob} dict per token
    (the sampled one plus the top alternatives)."""
    if not logprobs:
        return None
    return [float(entry[token]) for token, entry in zip(token_ids, logprobs)]
