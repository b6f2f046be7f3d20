"""What a worker counts as taken in: only its own model's requests (streams matches the count
against its releases for that model)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_consumers.worker import GpuWorker
from schemas import codec
from tests.streams.test_streams_gate import request


class Message:
    def __init__(self, record: dict, offset: int):
        self._value, self._headers = codec.encode("InferenceRequested", record)
        self._offset = offset

    def value(self):
        return self._value

    def headers(self):
        return self._headers

    def partition(self):
        return 0

    def offset(self):
        return self._offset

    def topic(self):
        return "work"

    def key(self):
        return None

    def error(self):
        return None


@pytest.mark.kafka
def test_other_models_records_are_skipped_and_not_counted_as_taken_in(kafka_bootstrap):
    engine = SimpleNamespace(max_num_seqs=4)
    worker = GpuWorker(engine, "mine", worker_id="intake-test")
    try:
        theirs = dict(request("a"), model="theirs")
        mine = dict(request("a"), model="mine")
        worker._take(Message(theirs, 0))
        worker._take(Message(theirs, 1))
        assert worker.consumed_total == 0 and worker.pending == []
        worker._take(Message(mine, 2))
        assert worker.consumed_total == 1 and [r["request_id"] for _, r in worker.pending] == [mine["request_id"]]
    finally:
        worker.consumer.close()
        worker.readers.close()
