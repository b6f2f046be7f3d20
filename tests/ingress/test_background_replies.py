"""A background response's events read back from `batch-results`: this request's events only, and a read
that cannot reach the partition's end says so instead of passing for the whole answer."""
from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Producer

from infra.kafka import clients as kafka_clients
from ingress.api.responses.background_replies import BackgroundReplies, reply_partition
from ingress.kafka.reads import ConsumerPool
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

    consumers = ConsumerPool("background-replies-test", idle=2)
    replies = BackgroundReplies(mine, partition, created_ms, consumers)
    try:
        with pytest.raises(TimeoutError):
            replies.read_to_end(timeout=0)  # no time to reach the end: not an answer with fewer tokens
    finally:
        replies.close()

    for _ in range(2):  # the second read is through the same consumer, given back and taken again
        replies = BackgroundReplies(mine, partition, created_ms, consumers)
        try:
            events = replies.read_to_end()
            assert [payload["request_id"] for _, payload in events] == [mine] * 200
            assert events[-1][1]["finish_reason"] == "stop"
        finally:
            replies.close()
    assert consumers.made == 1  # one librdkafka client for every read, not two per read
    consumers.close()


def test_a_reused_consumer_reads_another_partition_from_its_own_start(kafka_bootstrap):
    """A consumer given back after one response's read and taken for another's (another partition, an
    earlier offset) reads that one's events only, from its start, to its end."""
    consumers = ConsumerPool("background-replies-reuse", idle=1)
    producer = Producer(kafka_clients.producer_config("background-replies-reuse"))
    ids = [uuid.uuid4().hex for _ in range(2)]
    while reply_partition(ids[1]) == reply_partition(ids[0]):
        ids[1] = uuid.uuid4().hex
    created_ms = int(time.time() * 1000)
    for rid in ids:
        for i in range(5):
            _reply(producer, reply_partition(rid), rid, i, rid[:1], "stop" if i == 4 else None)
    assert producer.flush(15) == 0
    for rid in [ids[0], ids[1], ids[0]]:
        replies = BackgroundReplies(rid, reply_partition(rid), created_ms, consumers)
        try:
            events = replies.read_to_end()
        finally:
            replies.close()
        assert [(p["request_id"], p["first_token_index"]) for _, p in events] == [(rid, i) for i in range(5)]
    assert consumers.made == 1
    consumers.close()
