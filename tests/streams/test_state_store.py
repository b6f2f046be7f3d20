"""The gate's state topic: what a follower keeps, and what a takeover reads back."""
from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from infra.kafka import clients as kafka_clients
from streams import state_store
from streams.state_store import StateFollower, StateView


def test_view_keeps_the_latest_value_per_key_and_forgets_tombstoned_keys():
    view = StateView()
    for offset, (key, value) in enumerate([(b"a", b"1"), (b"b", b"2"), (b"a", b"3"), (b"b", None)]):
        view.apply(offset, key, value)
    assert view.values == {b"a": b"3"}
    assert view.next_offset == 4
    view.apply(1, b"b", b"stale redelivery")  # below the position: already applied
    assert view.values == {b"a": b"3"}
    view.reached(10)  # the end, past records compaction removed
    assert view.next_offset == 10


def test_entries_round_trip_through_json_with_none_as_a_tombstone():
    records = state_store.encode_entries({"fq": {"floor": 1.5}, "r/x": None})
    assert records == [(b"fq", b'{"floor":1.5}'), (b"r/x", None)]
    assert state_store.decode_entries({k: v for k, v in records if v is not None}) == {"fq": {"floor": 1.5}}


@pytest.mark.kafka
def test_snapshot_holds_every_entry_written_before_it_even_from_a_follower_started_late(kafka_bootstrap):
    topic = f"state-test-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1,
                                  config={"cleanup.policy": "compact"})])[topic].result()
    producer = Producer(kafka_clients.producer_config("state-test"))
    early = StateFollower(topic, "early")
    try:
        for i in range(500):
            state_store.write(producer, topic, {f"r/{i}": {"i": i}, "pos": {"n": i}})
            if i % 2:
                state_store.write(producer, topic, {f"r/{i}": None})
        producer.flush(10)
        expected = {f"r/{i}": {"i": i} for i in range(0, 500, 2)} | {"pos": {"n": 499}}
        assert early.snapshot() == expected
        late = StateFollower(topic, "late")
        try:
            assert late.snapshot() == expected
            state_store.write(producer, topic, {"pos": {"n": 500}})
            producer.flush(10)
            assert late.snapshot()["pos"] == {"n": 500}
        finally:
            late.close()
    finally:
        early.close()
