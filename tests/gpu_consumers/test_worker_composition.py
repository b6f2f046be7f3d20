"""GpuWorker wires its parts together: an assignment is advertised, a partition given up takes its
running request down unbilled and is advertised away, and a request that ends is billed and settles
its offset. The parts' own tests cover each job; this one covers the callbacks between them."""
from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest
from confluent_kafka import TopicPartition

from gpu_consumers.worker import GpuWorker
from infra.kafka import clients as kafka_clients
from tests.gpu_consumers.test_worker_intake import Message
from tests.streams.test_streams_gate import request


class FakeEngine:
    """Enough of the engine for intake, one step and an advert: every request ends at its first step."""

    max_num_seqs, num_total_blocks, block_size, prefix_cache_version = 4, 64, 16, 0
    stats: dict = {}

    def __init__(self):
        self.running: list[str] = []
        self.aborted: list[str] = []

    def can_admit(self, tokens):
        return True

    def add_request(self, request_id, prompt_token_ids, params, **kwargs):
        self.running.append(request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.running = [r for r in self.running if r != request_id]

    def step(self):
        ended, self.running = self.running, []
        return [SimpleNamespace(request_id=rid, finished=True, finish_reason="stop", new_token_ids=[7],
                                choice_index=0, completion_tokens=1, cached_tokens=0, text_delta="x",
                                first_token_index=0, logprobs=None, prompt_tokens=8) for rid in ended]

    def num_free_slots(self):
        return self.max_num_seqs - len(self.running)

    def num_free_blocks(self):
        return self.num_total_blocks

    def cached_block_hashes(self, limit):
        return []


class AssigningConsumer:
    def committed(self, partitions, timeout):
        return [TopicPartition(p.topic, p.partition, 5) for p in partitions]

    def incremental_assign(self, partitions):
        pass

    def assignment(self):
        return []


@pytest.mark.kafka
def test_the_worker_parts_call_each_other_through_one_book(kafka_bootstrap, monkeypatch):
    produced: list[tuple[str, str, dict]] = []

    def delivered_at_once(producer, topic, key, name, record, partition=None, on_delivery=None):
        produced.append((topic, name, record))
        if on_delivery is not None:
            on_delivery(None, None)

    monkeypatch.setattr(kafka_clients, "produce_event", delivered_at_once)
    engine = FakeEngine()
    worker = GpuWorker(engine, "tiny", worker_id=f"composition-{uuid.uuid4().hex[:6]}")  # type: ignore[arg-type]
    try:
        consumer = AssigningConsumer()
        worker.partitions.on_assign(consumer, [TopicPartition("work", 0), TopicPartition("work", 1)])
        adverts = [r for _, name, r in produced if name == "CapacityAdvertised"]
        assert adverts[-1]["work_partitions"] == [0, 1]

        live = int((time.time() + 60) * 1000)
        kept, lost = (dict(request("a"), model="tiny", deadline_ms=live) for _ in range(2))
        worker.intake.take(Message(kept, 5, partition=0))
        worker.intake.take(Message(lost, 5, partition=1))
        worker.intake.start_pending()
        assert set(worker.book.in_flight) == {kept["request_id"], lost["request_id"]}

        worker.partitions.on_lost(consumer, [TopicPartition("work", 1)])
        assert engine.aborted == [lost["request_id"]] and set(worker.book.in_flight) == {kept["request_id"]}
        assert [r for _, name, r in produced if name == "CapacityAdvertised"][-1]["work_partitions"] == [0]

        worker.fetch.stepped(worker.steps.step(), worker.steps.last_step_s)
        usage = [r for _, name, r in produced if name == "RequestCompleted"]
        assert [u["request_id"] for u in usage] == [kept["request_id"]]  # the lost one is not billed here
        assert worker.settlements.due and worker.offsets.committable()[0][0] == 6
        assert worker.fetch.ended_last_step == 1
    finally:
        worker.partitions.close()
        worker.readers.close()


@pytest.mark.kafka
def test_an_idle_worker_turns_and_shuts_down_with_a_stopping_advert(kafka_bootstrap, monkeypatch):
    produced: list[tuple[str, dict]] = []
    monkeypatch.setattr(kafka_clients, "produce_event",
                        lambda producer, topic, key, name, record, **kw: produced.append((name, record)))
    engine = FakeEngine()
    engine.has_unfinished_requests = lambda: bool(engine.running)  # type: ignore[method-assign]
    worker = GpuWorker(engine, "composition-idle", worker_id=f"idle-{uuid.uuid4().hex[:6]}")  # type: ignore[arg-type]
    worker.partitions.subscribe()
    worker.control.open()
    for _ in range(3):
        worker.turn()  # nothing in `work` for this model: fetches, commits and heals with nothing to do
    worker.stop()
    worker.shutdown()
    assert worker.stopping and worker.stall_watch.stopped
    assert produced[-1][0] == "CapacityAdvertised" and produced[-1][1]["stopping"]
    assert produced[-1][1]["work_partitions"] == []
