"""FetchWatch names a partition that has records beyond our position which we do not fetch."""
import threading

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from infra.kafka.fetch_watch import FetchWatch

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


def _metadata(leaders: dict[str, dict[int, int]], brokers: list[int]):
    """A list_topics() answer: each topic's partitions with their leader, and the live brokers."""
    from types import SimpleNamespace

    return SimpleNamespace(brokers={b: None for b in brokers}, topics={
        t: SimpleNamespace(partitions={p: SimpleNamespace(leader=leader) for p, leader in parts.items()})
        for t, parts in leaders.items()})


def _answered(request, end: int, failed: tuple[int, ...] = ()):
    """offsets_for_times' answer: each partition with its end, or an error."""
    return [TopicPartition(tp.topic, tp.partition, -1) if tp.partition in failed else
            TopicPartition(tp.topic, tp.partition, end) for tp in request]


def test_a_client_that_fails_every_call_is_replaced_and_stalls_are_seen_again():
    """End offsets are asked through one client; after a series of broker restarts one failed every
    call for good, so a stuck input consumer was never noticed (streams stopped serving)."""
    made = []

    class Client:
        def __init__(self, config):
            self.broken = not made  # the first client is the broken one
            self.closed = threading.Event()
            made.append(self)

        def list_topics(self, topic=None, timeout=None):
            return _metadata({topic: {0: 1}}, brokers=[1])

        def offsets_for_times(self, request, timeout=None):
            if self.broken:
                raise KafkaException(KafkaError(KafkaError._TRANSPORT))
            return _answered(request, 100)

        def close(self):
            self.closed.set()

    watch = FetchWatch("unused", stall_after_s=6.0, check_every_s=2.0, client_factory=Client)
    positions = {("requests", 0): 40}
    for t in (0.0, 2.0, 4.0, 6.0, 8.0):
        assert watch.stalled(positions, now=t) == []
    assert len(made) == 1
    assert watch.stalled(positions, now=10.0) == [] and len(made) == 2  # replaced after 10 s of failures
    assert made[0].closed.wait(5)  # the old one is closed (in the background)
    assert watch.stalled(positions, now=12.0) == []  # the new client answers: lagging from here
    assert watch.stalled(positions, now=18.0) == [("requests", 0)]


def test_ends_are_asked_on_fresh_metadata_and_only_where_a_live_broker_leads():
    """After a broker of a cluster died, a client that asked on its old metadata (an admin client did)
    reconnected to the dead broker in a tight loop, a core busy in every process, and failed every
    call until it was replaced. Each ask refreshes the metadata first, and a partition whose leader
    is gone (or none) is left out until it has one again."""
    calls = []

    class Client:
        def __init__(self, config):
            self.config = config

        def list_topics(self, topic=None, timeout=None):
            calls.append(("metadata", topic))
            return _metadata({"work": {0: 1, 1: 3, 2: -1}, "capacity": {0: 2}}, brokers=[1, 2])

        def offsets_for_times(self, request, timeout=None):
            calls.append(("ends", sorted((tp.topic, tp.partition, tp.offset) for tp in request)))
            return _answered(request, 50)

    watch = FetchWatch("127.0.0.1:1,127.0.0.1:2", client_factory=Client)
    assert watch._client.config["bootstrap.servers"] == "127.0.0.1:1,127.0.0.1:2"
    assert watch._client.config["isolation.level"] == "read_committed"  # the ends a reader can reach
    positions = {("work", 0): 10, ("work", 1): 10, ("work", 2): 10, ("capacity", 0): 10}
    assert watch.stalled(positions, now=0.0) == []
    assert calls == [("metadata", "capacity"), ("metadata", "work"),
                     ("ends", [("capacity", 0, -1), ("work", 0, -1)])]  # -1: the latest offset
    # the ones asked are watched; the leaderless ones are not taken for stalled meanwhile
    assert watch.stalled(positions, now=4.0) == [("work", 0), ("capacity", 0)]


def test_a_partition_whose_end_could_not_be_read_is_not_judged():
    class Client:
        def __init__(self, config):
            pass

        def list_topics(self, topic=None, timeout=None):
            return _metadata({"work": {0: 1, 1: 2}}, brokers=[1, 2])

        def offsets_for_times(self, request, timeout=None):
            return _answered(request, 50, failed=(1,))

    watch = FetchWatch("unused", stall_after_s=3.0, check_every_s=1.0, client_factory=Client)
    positions = {("work", 0): 10, ("work", 1): 10}
    for t in range(4):
        assert watch.stalled(positions, now=float(t)) == ([("work", 0)] if t == 3 else [])
