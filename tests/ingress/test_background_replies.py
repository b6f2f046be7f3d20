"""A background response's events read back from `batch-results`: this request's events only, and a read
that cannot reach the partition's end says so instead of passing for the whole answer."""
from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Producer

from infra import kafka_clients
from ingress.api.responses.background_replies import BackgroundReplies, reply_partition
from schemas import codec, topics

pytestmark = pytest.mark.kafka


def _reply(producer: Producer, partition: int, request_id: str, first: int, text: str, finish: str | None = None):
    item = {"request_id": request_id, "choice_index": 0, "first_token_index": first, "token_ids": [first],
            "text": text, "finish_reason": finish}
    record = codec.new_event("ReplyBatch", items=[item])
    kafka_clients.produce_event(producer, topics.BATCH_RESULTS.name, None, "ReplyBatch", record, partition=partition)


def test_read_to_end_is_this_request_only_and_never_a_partial_read(kafka_bootstrap):
    mine, other = uuid.uuid4().hex, uuid.uuid4().hex
    partition = reply_partition(mine)
    created_ms = int(time.time() * 1000)
    producer = Producer(kafka_clients.producer_config("background-replies-test"))
    for i in range(200):
        _reply(producer, partition, other, i, "o")
        _reply(producer, partition, mine, i, "m", "stop" if i == 199 else None)
    assert producer.flush(15) == 0

    replies = BackgroundReplies(mine, partition, created_ms, "background-replies-test")
    try:
        with pytest.raises(TimeoutError):
            replies.read_to_end(timeout=0)  # no time to reach the end: not an answer with fewer tokens
    finally:
        replies.close()

    replies = BackgroundReplies(mine, partition, created_ms, "background-replies-test")
    try:
        events = replies.read_to_end()
        assert [payload["request_id"] for _, payload in events] == [mine] * 200
        assert events[-1][1]["finish_reason"] == "stop"
    finally:
        replies.close()
