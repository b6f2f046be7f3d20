"""The self-healing group member (infra/kafka/group_consumer.py): when it replaces its client, and that the
owner only ever hears from the current one. Pure logic: the clients are stand-ins, the clock is real
but every bound is zero."""
from __future__ import annotations

from confluent_kafka import TopicPartition

from infra.kafka.fetch_watch import FetchWatch
from infra.kafka.group_consumer import Healing, HealingGroupConsumer

TOPIC = "work"
AT_ONCE = Healing(rejoin_after_s=0.0, stall_after_s=0.0, check_every_s=0.0)
NEVER_BY_TIME = Healing(rejoin_after_s=3600.0, stall_after_s=0.0, check_every_s=0.0)


class Client:
    """A group client that records its callbacks, so a test can play the rebalances."""

    def __init__(self):
        self.callbacks = {}
        self.partitions: list[TopicPartition] = []
        self.positions: dict[int, int] = {}
        self.commits: dict[int, int] = {}  # the group's committed offsets (none: -1001)
        self.closed = False

    def subscribe(self, topics, on_assign, on_revoke, on_lost):
        self.callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}

    def assign(self, *numbers):
        parts = [TopicPartition(TOPIC, n) for n in numbers]
        self.callbacks["assign"](self, parts)
        self.partitions += parts

    def revoke(self, *numbers, how="revoke"):
        parts = [TopicPartition(TOPIC, n) for n in numbers]
        self.callbacks[how](self, parts)
        self.partitions = [p for p in self.partitions if p.partition not in numbers]

    def assignment(self):
        return list(self.partitions)

    def position(self, parts):
        return [TopicPartition(TOPIC, p.partition, self.positions.get(p.partition, 0)) for p in parts]

    def committed(self, parts, timeout):
        return [TopicPartition(TOPIC, p.partition, self.commits.get(p.partition, -1001)) for p in parts]

    def close(self):
        self.closed = True


class Owner:
    def __init__(self):
        self.heard: list[tuple[str, Client, list[int]]] = []

    def callbacks(self):
        return {name: (lambda c, parts, name=name: self.heard.append((name, c, [p.partition for p in parts])))
                for name in ("on_assign", "on_revoke", "on_lost")}


def member(healing=AT_ONCE, ends=None, starts=None, **kwargs):
    made: list[Client] = []

    def make():
        made.append(Client())
        return made[-1]

    watch = FetchWatch("unused", stall_after_s=healing.stall_after_s, check_every_s=healing.check_every_s,
                       end_offsets=ends or (lambda keys: {}), log_starts=starts or (lambda keys: {}))
    m = HealingGroupConsumer(TOPIC, make, "test consumer", healing, fetch_watch=watch, **kwargs)
    m.subscribe()
    return m, made


def test_a_member_that_lost_every_partition_gets_a_fresh_client_past_the_bound_and_closes_the_old():
    m, made = member()
    made[0].assign(0, 1)
    assert m.heal() is False
    made[0].revoke(0, 1)
    assert m.heal() is True
    assert m.client is made[1] and made[0].closed
    assert made[1].callbacks, "the fresh client subscribed"


def test_losing_some_partitions_is_not_being_stuck():
    m, made = member()
    made[0].assign(0, 1)
    made[0].revoke(0)
    assert m.heal() is False
    made[0].revoke(1, how="lost")
    assert m.heal() is True


def test_the_owner_hears_only_from_the_current_client():
    owner = Owner()
    m, made = member(**owner.callbacks())
    old = made[0]
    old.assign(0)
    m.replace()
    old.revoke(0)  # the replaced client closing in the background gives its partitions up
    old.assign(3)
    made[1].assign(0)
    assert [(name, c is made[1], parts) for name, c, parts in owner.heard] == [
        ("on_assign", False, [0]), ("on_assign", True, [0])]
    assert owner.heard[0][1] is old


def test_on_lost_defaults_to_on_revoke():
    heard = []
    m, made = member(on_revoke=lambda c, parts: heard.append([p.partition for p in parts]))
    made[0].assign(2)
    made[0].revoke(2, how="lost")
    assert heard == [[2]]


def test_a_member_that_never_had_partitions_is_stuck_only_where_the_owner_says_so():
    strict, made_strict = member()
    assert strict.heal() is True
    lenient, made_lenient = member(rejoin_if_never_assigned=False)
    assert lenient.heal() is False and len(made_lenient) == 1
    made_lenient[0].assign(0)
    made_lenient[0].revoke(0)
    assert lenient.heal() is True


def test_a_partition_with_records_that_is_not_fetched_gets_a_fresh_client():
    m, made = member(NEVER_BY_TIME, ends=lambda keys: {k: 10 for k in keys})
    made[0].assign(0)
    made[0].positions[0] = 4
    assert m.heal() is False  # first sight of the lag
    assert m.heal() is True  # the position did not move although records are there
    assert m.client is made[1]


def test_a_moving_position_or_an_owner_that_fetches_nothing_on_purpose_is_not_a_stall():
    m, made = member(NEVER_BY_TIME, ends=lambda keys: {k: 10 for k in keys})
    made[0].assign(0)
    for position in (4, 5, 6):
        made[0].positions[0] = position
        assert m.heal() is False
    for _ in range(3):
        assert m.heal(expect_fetching=False) is False
    assert len(made) == 1


def test_a_partition_never_fetched_counts_from_its_commit_or_else_its_log_start_and_is_seen_stalled():
    # librdkafka gives no position before the first fetch (-1001); a new pool's group has no commit either
    m, made = member(NEVER_BY_TIME, ends=lambda keys: {k: 10 for k in keys}, starts=lambda keys: {k: 3 for k in keys})
    made[0].assign(0, 1)
    made[0].positions = {0: -1001, 1: -1001}
    made[0].commits = {0: 10}  # partition 0 is read to its end; partition 1 has records from 3 on
    assert m.heal() is False  # first sight of partition 1's lag
    assert m.heal() is True
    assert m.client is made[1]


def test_an_unfetched_partition_with_nothing_past_its_log_start_is_not_a_stall():
    # everything before 10 was deleted by retention: nothing to read
    m, made = member(NEVER_BY_TIME, ends=lambda keys: {k: 10 for k in keys}, starts=lambda keys: {k: 10 for k in keys})
    made[0].assign(0)
    made[0].positions = {0: -1001}
    for _ in range(3):
        assert m.heal() is False
    assert len(made) == 1
