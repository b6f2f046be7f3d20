"""The records the gate sends, built from the request records it holds.

Every builder returns an ``Output``: the record with where it goes. The owner loop
(owner.py) produces them in its transaction; none of them is sent from here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from schemas import codec
from schemas.records import (
    InferenceRequested,
    PreemptRequested,
    QuotaState,
    RequestCancelled,
    RequestCompleted,
    RequestError,
)

# What an Output carries: `work` releases, answers on reply topics, `usage`, `preemptions`,
# `cancellations` and `quota-state` records.
OutputRecord = InferenceRequested | RequestError | RequestCompleted | PreemptRequested | RequestCancelled | QuotaState

Record = TypeVar("Record")


@dataclass
class Output:
    topic: str
    key: str | None
    event: str
    record: OutputRecord
    partition: int | None = None
    release_of: str | None = None  # set on a `work` record: delivery is tracked


def new_record(kind: type[Record], **fields: Any) -> Record:
    """A new event of `kind` (its class in schemas/records.py, named as the event), the envelope
    fields filled in by the codec."""
    return cast(Record, codec.new_event(kind.__name__, **fields))


def streamed_tokens(rec: InferenceRequested) -> int:
    """Tokens a queued request already streamed (non-zero only after a preemption)."""
    resume = rec.get("resume")
    return len(resume.get("completion_token_ids") or []) if resume else 0


def ran(rec: InferenceRequested) -> bool:
    """Whether a queued request had reached a GPU before (it was preempted after starting): its
    prompt and streamed tokens are then billed whatever ends it; one that never ran bills nothing."""
    resume = rec.get("resume")
    if not resume:
        return False
    return resume.get("started_at_ms") is not None or streamed_tokens(rec) > 0


def request_error(rec: InferenceRequested, status: int, error_type: str, code: str, message: str,
                  retry_after: float | None) -> Output:
    """The answer to the request's client (on its reply address) that it ends without tokens."""
    err = new_record(RequestError, request_id=rec["request_id"], status_code=status, error_type=error_type,
                     code=code, message=message, retry_after_s=None if retry_after is None else float(retry_after))
    return Output(rec["reply_topic"], rec["request_id"], "RequestError", err, partition=rec["reply_partition"])


def rejection(rec: InferenceRequested, status: int, error_type: str, code: str, message: str,
              retry_after: float | None) -> Output:
    """A refusal at admission: a request error whose retry-after is rounded up to the millisecond."""
    if retry_after is not None:
        retry_after = math.ceil(retry_after * 1000) / 1000
    return request_error(rec, status, error_type, code, message, retry_after)


def request_completed(rec: InferenceRequested, status: str, finish_reason: str, now: float,
                      usage_topic: str) -> Output:
    """The usage event of a request streams ends itself (shed, cancelled while queued). A preempted
    one reports the tokens it streamed and its first start, so the ledger bills them whatever the
    status; one that never ran reports no start and no completion token, and is not billed."""
    now_ms = int(now * 1000)
    resume = rec.get("resume")
    first = resume.get("first_token_at_ms") if resume else None
    started = resume.get("started_at_ms") if resume else None
    usage = new_record(
        RequestCompleted, request_id=rec["request_id"], tenant_id=rec["tenant_id"], model=rec["model"],
        status=status, finish_reason=finish_reason, priority=rec.get("priority", "interactive"),
        prompt_tokens=len(rec["prompt_token_ids"]), completion_tokens=streamed_tokens(rec), cached_tokens=0,
        reserved_tokens=int(rec.get("reserved_tokens") or 0), arrived_at_ms=rec["arrived_at_ms"],
        started_at_ms=started, first_token_at_ms=first, finished_at_ms=now_ms,
        ttft_ms=None if first is None else float(first - rec["arrived_at_ms"]), tpot_ms=None,
        queue_ms=float(max(0, now_ms - rec["arrived_at_ms"])), worker_id=None,
        api_key_id=rec.get("api_key_id"), batch_id=rec.get("batch_id"))
    return Output(usage_topic, rec["tenant_id"], "RequestCompleted", usage)


def released_work(rec: InferenceRequested, now: float, work_topic: str, partition: int | None) -> Output:
    """The request released to `work`, stamped with its release time; its delivery is tracked."""
    work = rec.copy()
    work["released_at_ms"] = int(now * 1000)
    return Output(work_topic, rec["request_id"], "InferenceRequested", work, partition=partition,
                  release_of=rec["request_id"])


def preempt_requested(victim_id: str, tenant_id: str, model: str, reason: str, for_request_id: str,
                      topic: str) -> Output:
    record = new_record(PreemptRequested, request_id=victim_id, tenant_id=tenant_id, model=model, reason=reason,
                        for_request_id=for_request_id)
    return Output(topic, victim_id, "PreemptRequested", record)


def request_cancelled(request_id: str, tenant_id: str, reason: str, topic: str) -> Output:
    record = new_record(RequestCancelled, request_id=request_id, tenant_id=tenant_id, reason=reason)
    return Output(topic, request_id, "RequestCancelled", record)
