"""FetchWatch names a partition that has records beyond our position which we do not fetch."""
from confluent_kafka import KafkaError, KafkaException

from infra.fetch_watch import FetchWatch

A, B = ("capacity", 0), ("capacity", 1)


def watch(ends):
    def end_offsets(keys):
        if ends is None:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))
        return {k: ends[k] for k in keys}
    return FetchWatch("unused", stall_after_s=6.0, check_every_s=2.0, end_offsets=end_offsets)


def test_a_partition_behind_its_end_without_moving_is_stalled_after_the_bound():
    ends = {A: 10, B: 5}
    w = watch(ends)
    assert w.stalled({A: 7, B: 5}, now=100.0) == []  # A is behind: the clock starts
    assert w.stalled({A: 7, B: 5}, now=104.0) == []
    assert w.stalled({A: 7, B: 5}, now=106.5) == [A]


def test_a_partition_that_moves_or_reaches_its_end_is_not_stalled():
    ends = {A: 10, B: 5}
    w = watch(ends)
    w.stalled({A: 7, B: 5}, now=100.0)
    assert w.stalled({A: 8, B: 5}, now=104.0) == []  # it moved: the clock restarts
    assert w.stalled({A: 8, B: 5}, now=108.0) == []
    ends[A] = 8
    assert w.stalled({A: 8, B: 5}, now=111.0) == []  # caught up


def test_nothing_is_stalled_while_the_broker_is_away_or_between_checks():
    w = watch(None)
    for t in range(100, 130, 2):
        assert w.stalled({A: 0}, now=float(t)) == []
    w2 = watch({A: 10})
    w2.stalled({A: 0}, now=100.0)
    assert not w2.due(now=101.0) and w2.stalled({A: 0}, now=107.0) == [A]


def test_an_admin_client_that_fails_every_call_is_replaced_and_stalls_are_seen_again():
    """End offsets are asked through one admin client; after a series of broker restarts one failed
    every call for good, so a stuck input consumer was never noticed (streams stopped serving)."""
    made = []

    class Admin:
        def __init__(self, config):
            self.broken = not made  # the first client is the broken one
            made.append(self)

        def list_offsets(self, request, request_timeout=None):
            if self.broken:
                raise KafkaException(KafkaError(KafkaError._TRANSPORT))
            return {tp: _Done(100) for tp in request}

    watch = FetchWatch("unused", stall_after_s=6.0, check_every_s=2.0, admin_factory=Admin)
    positions = {("requests", 0): 40}
    for t in (0.0, 2.0, 4.0, 6.0, 8.0):
        assert watch.stalled(positions, now=t) == []
    assert len(made) == 1
    assert watch.stalled(positions, now=10.0) == [] and len(made) == 2  # replaced after 10 s of failures
    assert watch.stalled(positions, now=12.0) == []  # the new client answers: lagging from here
    assert watch.stalled(positions, now=18.0) == [("requests", 0)]


class _Done:
    def __init__(self, offset):
        self.offset = offset

    def result(self):
        return self
