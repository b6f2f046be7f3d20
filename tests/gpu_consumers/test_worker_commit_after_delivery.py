"""A request's `work` offset is committable only once the broker has its last reply and its usage.

The lost request of issue 31: a worker finished a short request, committed the offset past it at
once, and was SIGKILLed before librdkafka had sent the final ReplyBatch; the new owner of the
partition started past it, and the client, holding only its first token, got a 504."""
from __future__ import annotations

import time
from types import SimpleNamespace

from gpu_consumers.after_delivery import AfterDelivery
from tests.gpu_consumers.test_worker_intake import Message
from tests.gpu_consumers.test_worker_redelivery import RecordingEngine
from tests.gpu_consumers.worker_parts import parts_without_kafka
from tests.streams.test_streams_gate import request


class HeldProducer:
    """Keeps every produced event's delivery callback until the test delivers it."""

    def __init__(self):
        self.sent: list[tuple[str, object]] = []

    def produce(self, topic, on_delivery=None, **_kwargs):
        self.sent.append((topic, on_delivery))

    def deliver(self, topic: str | None = None, err=None) -> int:
        due = [(t, cb) for t, cb in self.sent if topic is None or t == topic]
        self.sent = [(t, cb) for t, cb in self.sent if (t, cb) not in due]
        for _topic, callback in due:
            if callback is not None:
                callback(err, None)
        return len(due)


class OneStepEngine(RecordingEngine):
    """Runs every added request to its end in a single step, two tokens each."""

    def step(self):
        added, self.added = self.added, []
        return [SimpleNamespace(request_id=rid, finished=True, finish_reason="stop", new_token_ids=[7, 8],
                                choice_index=0, completion_tokens=2, cached_tokens=0, text_delta="hi",
                                first_token_index=0, logprobs=None, prompt_tokens=8) for rid in added]

    def abort(self, request_id):
        pass


def running_worker(*records: dict):
    worker = parts_without_kafka(records[0]["model"], OneStepEngine(), HeldProducer())
    for offset, record in enumerate(records, start=5):
        worker.intake.take(Message(record, offset))
    worker.intake.start_pending()
    return worker


def live(**kw) -> dict:
    return dict(request("a", **kw), deadline_ms=int((time.time() + 60) * 1000))


def test_a_finished_request_is_committable_only_after_its_last_reply_and_usage_are_delivered():
    worker = running_worker(live())
    worker.steps.step()
    assert not worker.book.in_flight
    assert worker.offsets.committable()[0][0] == 5, "committable before the final reply reached the broker"

    assert worker.producer.deliver("replies") == 1
    assert worker.offsets.committable()[0][0] == 5, "committable before the usage event reached the broker"
    assert not worker.settlements.due

    assert worker.producer.deliver("usage") == 1
    assert worker.offsets.committable()[0][0] == 6
    assert worker.settlements.due, "a request just settled should be committed at the next turn"


def test_one_reply_batch_ending_two_requests_settles_both():
    worker = running_worker(live(), live())  # same reply partition: one ReplyBatch carries both ends
    worker.steps.step()
    assert [topic for topic, _ in worker.producer.sent].count("replies") == 1
    worker.producer.deliver()
    assert worker.offsets.committable()[0][0] == 7


def test_an_undelivered_ending_leaves_the_offset_for_the_next_owner():
    worker = running_worker(live())
    worker.steps.step()
    worker.producer.deliver("replies", err="_MSG_TIMED_OUT")
    worker.producer.deliver("usage")
    assert worker.offsets.committable()[0][0] == 5


def test_a_cancel_and_an_unstarted_end_wait_for_their_events_too():
    running, late = live(), dict(request("a"), deadline_ms=int((time.time() - 1) * 1000))
    worker = running_worker(running, late)  # `late` is shed unstarted: its error reply + usage
    worker.control.cancel(running["request_id"])
    assert worker.offsets.committable()[0][0] == 5
    worker.producer.deliver("usage")  # both usages, not yet the shed one's error reply
    assert worker.offsets.committable()[0][0] == 6
    worker.producer.deliver("replies")
    assert worker.offsets.committable()[0][0] == 7


def test_after_delivery_runs_once_when_sealed_and_everything_is_in():
    ran: list[int] = []
    settle = AfterDelivery("r", lambda: ran.append(1))
    first, second = settle.expect(), settle.expect()
    first(None)
    settle.seal()
    assert ran == []
    second(None)
    assert ran == [1]
    settle.seal()
    assert ran == [1]


def test_after_delivery_with_nothing_to_wait_for_runs_at_seal():
    ran: list[int] = []
    settle = AfterDelivery("r", lambda: ran.append(1))
    settle.seal()
    assert ran == [1]
