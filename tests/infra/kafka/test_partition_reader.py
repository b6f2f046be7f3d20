"""PartitionReader reads on from where it was with a new client once its client stops fetching
records that the broker holds, and never re-reads or skips a record in doing so."""
from confluent_kafka import OFFSET_BEGINNING, KafkaError

from infra.kafka.fetch_watch import FetchWatch
from infra.kafka.partition_reader import PartitionReader

TENANTS = ("tenants", 0)


class Record:
    def __init__(self, topic, partition, offset, value=None, eof=False):
        self._t, self._p, self._o, self._v, self._eof = topic, partition, offset, value, eof

    def topic(self):
        return self._t

    def partition(self):
        return self._p

    def offset(self):
        return self._o

    def value(self):
        return self._v

    def error(self):
        return KafkaError(KafkaError._PARTITION_EOF) if self._eof else None


class FakeBroker:
    """One log per partition; the clients it hands out fetch from it, except those it stalls.
    A log may start past offset 0, as a compacted or trimmed one does."""

    def __init__(self, logs: dict, first: dict | None = None):
        self.logs = logs
        self.first = first or {}
        self.stall_next = 0  # how many clients to come never fetch anything
        self.clients = []

    def ends(self, keys):
        return {k: self.first.get(k, 0) + len(self.logs[k]) for k in keys}

    def client(self, config):
        stalled = self.stall_next > 0
        self.stall_next -= stalled
        client = FakeClient(self, stalled)
        self.clients.append(client)
        return client


class FakeClient:
    def __init__(self, broker, stalled):
        self.broker, self.stalled, self.closed = broker, stalled, False
        self.at: dict = {}
        self.at_end: set = set()

    def assign(self, tps):
        for tp in tps:
            key = (tp.topic, tp.partition)
            self.at[key] = self.broker.first.get(key, 0) if tp.offset == OFFSET_BEGINNING else tp.offset

    def _next(self):
        if self.stalled:
            return None
        for key, offset in self.at.items():
            first = self.broker.first.get(key, 0)
            offset = max(offset, first)  # a start below the log's beginning reads from its beginning
            log = self.broker.logs[key]
            if offset - first < len(log):
                self.at[key] = offset + 1
                self.at_end.discard(key)
                return Record(*key, offset, log[offset - first])
            if key not in self.at_end:
                self.at_end.add(key)
                return Record(*key, offset, eof=True)
        return None

    def poll(self, timeout):
        return self._next()

    def consume(self, num_messages, timeout):
        out = []
        while len(out) < num_messages and (msg := self._next()) is not None:
            out.append(msg)
        return out

    def close(self):
        self.closed = True


def reader(broker, starts):
    # Zero bounds: a partition seen behind its end twice without moving counts as stalled.
    watch = FetchWatch("unused", stall_after_s=0.0, check_every_s=0.0, end_offsets=broker.ends)
    return PartitionReader("test", starts, watch=watch, consumer_factory=broker.client)


def read_values(r, times):
    return [m.value() for _ in range(times) for m in r.read(0)]


def test_a_client_that_never_fetches_is_replaced_and_the_new_one_starts_where_reading_stood():
    broker = FakeBroker({TENANTS: ["a", "b", "c"]})
    r = reader(broker, {TENANTS: 0})
    assert read_values(r, 1) == ["a", "b", "c"]
    broker.logs[TENANTS] += ["d", "e"]
    broker.stall_next = 1
    r._consumer = broker.client({})  # as if the client had stopped fetching after a broker restart
    values = read_values(r, 4)
    assert values == ["d", "e"]
    assert r.replacements == 1 and broker.clients[-2].closed
    assert r.next_offset(TENANTS) == 5


def test_a_client_stalled_from_its_first_fetch_of_a_topic_read_from_the_beginning_is_replaced():
    broker = FakeBroker({TENANTS: ["a", "b"]})
    broker.stall_next = 1
    r = reader(broker, {TENANTS: OFFSET_BEGINNING})
    assert read_values(r, 4) == ["a", "b"]
    assert r.replacements == 1


def test_a_reader_at_its_end_or_reading_is_never_replaced():
    broker = FakeBroker({TENANTS: ["a"]})
    r = reader(broker, {TENANTS: OFFSET_BEGINNING})
    for value in "bcdef":
        broker.logs[TENANTS].append(value)
        read_values(r, 2)
    assert read_values(r, 3) == [] and r.replacements == 0
    assert r.next_offset(TENANTS) == 6


def test_reaching_the_end_of_a_log_that_starts_past_zero_counts_as_caught_up():
    # Offsets 0-2 were compacted away: no record ever moves the position there, the end event does.
    broker = FakeBroker({TENANTS: ["d"]}, first={TENANTS: 3})
    r = reader(broker, {TENANTS: OFFSET_BEGINNING})
    assert read_values(r, 3) == ["d"]
    assert r.next_offset(TENANTS) == 4 and r.replacements == 0
    broker.logs[TENANTS].clear()
    broker.first[TENANTS] = 4  # now nothing at all is left below the end
    r2 = reader(broker, {TENANTS: OFFSET_BEGINNING})
    assert read_values(r2, 3) == [] and r2.next_offset(TENANTS) == 4 and r2.replacements == 0
