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
