"""ResilientProducer replaces a client whose deliveries stall while the broker answers, and nothing
it was given is lost or reported twice (a fake client stands in for librdkafka's)."""
from __future__ import annotations

from types import SimpleNamespace

from confluent_kafka import KafkaError, KafkaException

from infra.kafka.resilient_producer import ResilientProducer


class FakeClient:
    """Delivers on poll unless it is `stuck`; answers metadata unless `unreachable`."""
    made: list["FakeClient"] = []
    stuck_first = True

    def __init__(self, config):
        self.stuck = FakeClient.stuck_first and not FakeClient.made
        self.unreachable = False
        self.queue: list[tuple] = []
        self.delivered: list[tuple] = []
        self.purged = False
        FakeClient.made.append(self)

    def produce(self, topic, key=None, value=None, headers=None, partition=None, on_delivery=None):
        self.queue.append((topic, value, on_delivery))

    def poll(self, timeout=0):
        if self.stuck:
            return 0
        served, self.queue = self.queue, []
        for topic, value, cb in served:
            self.delivered.append((topic, value))
            cb(None, None)
        return len(served)

    def flush(self, timeout=None):
        self.poll()
        return len(self.queue)

    def list_topics(self, timeout=None):
        if self.unreachable:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))
        return SimpleNamespace(topics={})

    def purge(self, in_queue=True, in_flight=True):
        self.purged = True
        purged, self.queue = self.queue, []
        for _, _, cb in purged:
            cb(KafkaError(KafkaError._PURGE_QUEUE), None)

    def __len__(self):
        return len(self.queue)


def make(stuck_first=True):
    FakeClient.made = []
    FakeClient.stuck_first = stuck_first
    producer = ResilientProducer({}, stall_after_s=8.0, client_factory=FakeClient)
    producer._reachable_since = 0.0  # the broker has answered all along
    return producer


def test_a_stalled_client_is_replaced_and_every_record_delivered_once_in_order():
    producer = make()
    confirmed = []
    for i in range(5):
        producer.produce("replies", value=str(i).encode(), on_delivery=lambda err, msg, i=i: confirmed.append((i, err)))
    first = FakeClient.made[0]
    assert not producer.check(now=first_time(producer) + 7.0)  # not stalled yet
    assert producer.check(now=first_time(producer) + 8.5)
    assert len(FakeClient.made) == 2 and first.purged
    producer.poll(0)
    assert [v for _, v in FakeClient.made[1].delivered] == [b"0", b"1", b"2", b"3", b"4"]
    assert confirmed == [(i, None) for i in range(5)]  # purge errors of the old client never reach callers
    assert producer.replacements == 1


def test_the_new_client_gets_a_whole_stall_period_before_it_is_replaced_again():
    producer = make()
    producer.produce("replies", value=b"x")
    t0 = first_time(producer)
    assert producer.check(now=t0 + 8.5)
    FakeClient.made[1].stuck = True
    assert not producer.check(now=t0 + 10.0)  # only 1.5 s on the new client
    assert producer.check(now=time_of_resend(producer) + 8.5)
    assert len(FakeClient.made) == 3


def test_after_an_outage_the_client_gets_a_whole_stall_period_from_the_brokers_return():
    producer = make()
    producer.produce("replies", value=b"x")
    t0 = first_time(producer)
    FakeClient.made[0].unreachable = True
    assert not producer.check(now=t0 + 12)  # queued through an outage (shorter than the hard bound)
    FakeClient.made[0].unreachable = False
    assert not producer.check(now=t0 + 14.5)  # back: the old client may still deliver
    assert not producer.check(now=t0 + 22)
    assert producer.check(now=t0 + 23)


def test_no_replacement_while_the_broker_is_away_or_nothing_waits():
    producer = make()
    assert not producer.check(now=10**6)  # nothing unconfirmed
    producer.produce("requests", value=b"x")
    FakeClient.made[0].unreachable = True
    assert not producer.check(now=first_time(producer) + 14)  # an outage: a new client would not help
    assert len(FakeClient.made) == 1


def test_a_client_that_says_unreachable_past_the_hard_bound_is_replaced_anyway():
    """The probe asks the stalled client itself; one broken for good says "unreachable" for good."""
    producer = make()
    producer.produce("capacity", value=b"advert")
    t0 = first_time(producer)
    FakeClient.made[0].unreachable = True
    assert not producer.check(now=t0 + 10)
    assert producer.check(now=t0 + 15.5)
    assert len(FakeClient.made) == 2 and FakeClient.made[0].purged
    FakeClient.made[1].unreachable = True  # a real outage: at most one new client per hard bound
    assert not producer.check(now=t0 + 20)
    assert producer.check(now=t0 + 31)
    FakeClient.made[2].stuck = False
    producer.poll()
    assert FakeClient.made[2].delivered == [("capacity", b"advert")]


def test_a_healthy_client_is_left_alone_and_flush_reports_what_is_left():
    producer = make(stuck_first=False)
    got = []
    producer.produce("usage", value=b"a", on_delivery=lambda err, msg: got.append(err))
    assert producer.flush(1) == 0
    assert got == [None] and len(FakeClient.made) == 1


def first_time(producer) -> float:
    return min(e.produced_at for e in producer._unconfirmed.values())


def time_of_resend(producer) -> float:
    return first_time(producer)
