"""The ledger against a real broker and real chDB: exactly one row per request, whatever
Kafka redelivers."""
from __future__ import annotations

import threading
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from billing_events import completed, produce_completed
from billing_pipeline import analytics, ledger
from billing_pipeline.consumer import LedgerWriter
from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from schemas import codec, topics
from tests.support.waiting import wait_until

pytestmark = pytest.mark.kafka


def tenant_rows(store, tenant):
    return store.rows("SELECT request_id, count() FROM {db}.ledger FINAL WHERE tenant_id = {t:String} "
                      "GROUP BY request_id ORDER BY request_id", {"t": tenant})


def tenant_tokens(store, tenant):
    return store.rows("SELECT count(), sum(total_tokens), sum(completion_tokens) FROM {db}.ledger FINAL "
                      "WHERE tenant_id = {t:String}", {"t": tenant})[0]


def agg_tokens(store, tenant):
    return store.rows("SELECT sum(requests), sum(total_tokens), sum(completion_tokens) FROM {db}.usage_minute FINAL "
                      "WHERE tenant_id = {t:String}", {"t": tenant})[0]


def group():
    return f"billing-test-{uuid.uuid4().hex[:8]}"


def test_one_row_per_request_and_replay_and_duplicates_change_nothing(store, producer):
    tenant = f"ten-{uuid.uuid4().hex[:8]}"
    events = [completed(f"{tenant}-r{i}", tenant, prompt=10 + i, completion=i % 7) for i in range(300)]
    produce_completed(producer, events)
    produce_completed(producer, events[:50])  # the same events again (a producer retry / worker redelivery)

    g = group()
    w = LedgerWriter(store, group_id=g, batch_max=64)
    w.drain(timeout=60)
    w.close()
    expected_tokens = sum(e["prompt_tokens"] + e["completion_tokens"] for e in events)
    expected_completion = sum(e["completion_tokens"] for e in events)
    rows = tenant_rows(store, tenant)
    assert len(rows) == 300 and all(n == 1 for _, n in rows)
    assert tenant_tokens(store, tenant) == (300, expected_tokens, expected_completion)
    assert agg_tokens(store, tenant) == (300, expected_tokens, expected_completion)

    # Replay the whole topic through a fresh consumer group into the same ledger.
    w2 = LedgerWriter(store, group_id=group(), batch_max=1000)
    w2.drain(timeout=60)
    w2.close()
    assert w2.stats.inserted >= 350
    assert tenant_tokens(store, tenant) == (300, expected_tokens, expected_completion)
    assert agg_tokens(store, tenant) == (300, expected_tokens, expected_completion)
    # The raw table did receive the duplicates: the idempotency is the table's, not luck.
    raw = store.scalar("SELECT count() FROM {db}.ledger WHERE tenant_id = {t:String}", {"t": tenant})
    assert raw >= 300


class Crash(Exception):
    pass


class CrashingWriter(LedgerWriter):
    """Inserts (and refreshes the aggregate) and then dies before committing offsets."""

    def commit(self, messages):
        raise Crash("killed between insert and commit")


def test_crash_between_insert_and_commit_does_not_double_count(store, producer):
    tenant = f"ten-{uuid.uuid4().hex[:8]}"
    events = [completed(f"{tenant}-r{i}", tenant, prompt=7, completion=3) for i in range(200)]
    g = group()
    # Join the group and read to the end first, so the crashing writer reads only our events.
    first = LedgerWriter(store, group_id=g)
    first.drain(timeout=60)
    first.close()
    produce_completed(producer, events)

    crashing = CrashingWriter(store, group_id=g, batch_max=10_000, batch_ms=1000)
    with pytest.raises(Crash):
        for _ in range(200):
            crashing.step()
    crashing.close()  # dies: nothing committed
    assert tenant_tokens(store, tenant)[0] > 0  # the insert did happen

    restarted = LedgerWriter(store, group_id=g)
    restarted.drain(timeout=60)
    restarted.close()
    assert restarted.stats.inserted >= 1  # it re-read what the crashed writer had written
    assert tenant_tokens(store, tenant) == (200, 2000, 600)
    assert agg_tokens(store, tenant) == (200, 2000, 600)


class UnansweredCommits:
    """A consumer whose group coordinator is gone: a synchronous commit blocks (as librdkafka's did after
    a broker restart, for minutes), an asynchronous one is sent and never answered."""

    HANG_S = 60.0

    def __init__(self, client):
        self.client = client

    def commit(self, *, offsets, asynchronous=True):
        if not asynchronous:
            threading.Event().wait(self.HANG_S)

    def __getattr__(self, name):
        return getattr(self.client, name)


class WriterWithoutCoordinator(LedgerWriter):
    @property
    def consumer(self):
        return UnansweredCommits(super().consumer)


def test_the_ledger_keeps_writing_while_its_commits_go_unanswered(store, producer):
    tenant = f"ten-{uuid.uuid4().hex[:8]}"
    events = [completed(f"{tenant}-r{i}", tenant, prompt=4, completion=2) for i in range(40)]
    g = group()
    first = LedgerWriter(store, group_id=g)  # joins the group at the topic's end: reads only our events
    first.drain(timeout=60)
    first.close()

    writer = WriterWithoutCoordinator(store, group_id=g, batch_ms=50).start()
    try:
        produce_completed(producer, events[:20])
        wait_until(lambda: tenant_tokens(store, tenant)[0] == 20, 30, "the first batch in the ledger")
        produce_completed(producer, events[20:])  # written only if the first batch's commit did not block
        wait_until(lambda: tenant_tokens(store, tenant)[0] == 40, 30, "the second batch in the ledger")
    finally:
        writer.stop()
    assert writer.error is None
    assert writer.stats.commits == 0  # no answer came: nothing was committed, everything was written

    restarted = LedgerWriter(store, group_id=g)
    restarted.drain(timeout=60)  # re-reads all 40 from the group's last commit
    restarted.close()
    assert restarted.stats.inserted >= 40
    assert tenant_tokens(store, tenant) == (40, 240, 80)
    assert agg_tokens(store, tenant) == (40, 240, 80)


def test_corrupt_events_are_dead_lettered_and_the_writer_keeps_going(store, producer):
    tenant = f"ten-{uuid.uuid4().hex[:8]}"
    good = [completed(f"{tenant}-r{i}", tenant) for i in range(20)]
    produce_completed(producer, good[:10])
    producer.produce(topics.USAGE.name, key=tenant.encode(), value=b"\x00\x01garbage",
                     headers=[("tm-event", b"RequestCompleted"), ("tm-schema-version", b"1")])
    producer.produce(topics.USAGE.name, key=tenant.encode(), value=b"no headers at all")
    bad_tokens = completed(f"{tenant}-bad", tenant, prompt=5, cached=9)  # cached > prompt: unbillable
    produce_completed(producer, [bad_tokens])
    produce_completed(producer, good[10:])

    g = group()
    w = LedgerWriter(store, group_id=g, client_id=f"writer-{tenant}")
    w.drain(timeout=60)
    w.close()
    assert tenant_tokens(store, tenant)[0] == 20
    assert w.stats.dead_lettered >= 3

    dl = Consumer(kafka_clients.consumer_config(group(), "t"))
    dl.subscribe([topics.DEAD_LETTERS.name])
    reasons = []
    for _ in range(150):
        msg = dl.poll(0.2)
        if msg is None or msg.error():
            if len(reasons) >= 3:
                break
            continue
        rec = codec.decode(msg.value(), msg.headers()).record
        # the writer's fresh group reads `usage` from its start: other modules' bad records are dead-lettered too
        if rec["consumer"] == f"writer-{tenant}" and rec["key"] == tenant.encode():
            reasons.append(rec["reason"])
    dl.close()
    assert len(reasons) == 3, reasons
    assert any("corrupt" in r for r in reasons)
    assert any("missing tm-event" in r for r in reasons)
    assert any("cached_tokens" in r for r in reasons)


def test_a_second_completion_of_a_request_moves_it_without_double_counting(store, producer):
    """A request regenerated after a worker crash may complete twice, in different minutes."""
    tenant = f"ten-{uuid.uuid4().hex[:8]}"
    t0 = 1_800_000_000_000 - 1_000  # 1 s before a minute boundary
    first = completed(f"{tenant}-r0", tenant, completion=4, finished_at_ms=t0)
    second = completed(f"{tenant}-r0", tenant, completion=4, finished_at_ms=t0 + 5_000)
    produce_completed(producer, [first])
    w = LedgerWriter(store, group_id=group())
    w.drain(timeout=60)
    produce_completed(producer, [second])
    w.drain(timeout=60)
    w.close()
    assert tenant_tokens(store, tenant) == (1, 14, 4)
    buckets = store.rows("SELECT toUnixTimestamp(minute), requests FROM {db}.usage_minute FINAL "
                         "WHERE tenant_id = {t:String} ORDER BY minute", {"t": tenant})
    assert buckets == [((t0 // 60_000) * 60, 0), ((t0 // 60_000) * 60 + 60, 1)]
    assert agg_tokens(store, tenant) == (1, 14, 4)


def test_aggregate_matches_ledger_per_tenant_model_minute(store, producer):
    tenant = f"ten-{uuid.uuid4().hex[:8]}"
    base = 1_790_000_000_000
    events = []
    for i in range(400):
        events.append(completed(f"{tenant}-r{i}", f"{tenant}-{i % 3}", model=f"m{i % 2}",
                                status=("finished", "cancelled", "failed", "shed")[i % 4],
                                prompt=20 + i % 11, cached=i % 5, completion=i % 13,
                                finished_at_ms=base + i * 1_700))
    produce_completed(producer, events + events[::7])
    w = LedgerWriter(store, group_id=group(), batch_max=97)
    w.drain(timeout=60)
    w.close()
    from_ledger = store.rows(
        "SELECT tenant_id, model, toStartOfMinute(finished_at) AS m, count(), sumIf(total_tokens, billable=1), "
        "sumIf(cached_tokens, billable=1), sumIf(completion_tokens, billable=1), sum(cost_pusd) "
        "FROM {db}.ledger FINAL WHERE startsWith(tenant_id, {t:String}) GROUP BY tenant_id, model, m "
        "ORDER BY tenant_id, model, m", {"t": tenant})
    from_agg = store.rows(
        "SELECT tenant_id, model, minute, requests, total_tokens, cached_tokens, completion_tokens, cost_pusd "
        "FROM {db}.usage_minute FINAL WHERE startsWith(tenant_id, {t:String}) AND requests > 0 "
        "ORDER BY tenant_id, model, minute", {"t": tenant})
    assert len(from_ledger) > 20
    assert [tuple(int(x) if isinstance(x, int) else x for x in r) for r in from_ledger] == \
           [tuple(int(x) if isinstance(x, int) else x for x in r) for r in from_agg]
    # the rebuild tool gives the same buckets
    ledger.rebuild_aggregate(store)
    again = store.rows(
        "SELECT tenant_id, model, minute, requests, total_tokens, cached_tokens, completion_tokens, cost_pusd "
        "FROM {db}.usage_minute FINAL WHERE startsWith(tenant_id, {t:String}) AND requests > 0 "
        "ORDER BY tenant_id, model, minute", {"t": tenant})
    assert again == from_agg
    # shed requests are recorded but not billed
    totals = analytics.tenant_totals(store, f"{tenant}-0")
    assert totals["total"]["shed"] > 0


def test_usage_written_in_a_transaction_is_drained_to_its_end(store, kafka_bootstrap):
    """The streams gate writes `usage` (the completions of shed requests) in transactions, so a
    partition can end in a commit marker no record is delivered at. The writer commits past it
    once idle; committing only after delivered records left such a partition one behind its end
    for good (a fresh-clone run's drains all timed out after a stack had shed a request)."""
    tenant = f"ten-{uuid.uuid4().hex[:8]}"
    events = [completed(f"{tenant}-r{i}", tenant, prompt=5, completion=2) for i in range(20)]
    tx = Producer(kafka_clients.producer_config("billing-test-tx", **{"transactional.id": f"tx-{tenant}"}))
    tx.init_transactions(30)
    tx.begin_transaction()
    produce_completed(tx, events)
    tx.commit_transaction(30)

    w = LedgerWriter(store, group_id=group(), batch_max=1000)
    w.drain(timeout=60)
    parts = [TopicPartition(topics.USAGE.name, p) for p in range(topics.USAGE.partitions)]
    committed = {tp.partition: tp.offset for tp in w.consumer.committed(parts, timeout=10)}
    ends = topic_reader.end_offsets(topics.USAGE.name)
    w.close()
    assert tenant_tokens(store, tenant) == (20, 20 * 7, 20 * 2)
    assert all(committed[p] == ends[p] for p in ends if ends[p] > 0), (committed, ends)
