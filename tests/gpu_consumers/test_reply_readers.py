"""Which reply addresses still have a reader: the verdicts, and the reader that keeps them current."""
import threading

from gpu_consumers.reply_readers import MISSED_BEATS, RECONNECT_GRACE_MS, HeartbeatTable

# A view that has been confirmed complete, without a break, since long before these tests' beats.
SETTLED = -60_000
SILENCE = MISSED_BEATS * 1000  # what a reader beating every second may miss before it counts as gone


def confirmed(start=SETTLED):
    table = HeartbeatTable()
    confirm(table, start, 9_000)
    return table


def confirm(table, start, end, step=250):
    """Confirm the view every `step` ms from start to end, as the reader thread does."""
    for t in range(start, end + 1, step):
        table.mark_complete(t)


def beat(incarnation, ts, stopping=False, partition=0):
    return {"reply_topic": "replies", "reply_partition": partition, "incarnation": incarnation,
            "timestamp_ms": ts, "interval_ms": 1000, "stopping": stopping}


def request(incarnation, arrived=10_000, partition=0):
    return {"reply_topic": "replies", "reply_partition": partition, "reply_incarnation": incarnation,
            "arrived_at_ms": arrived}


def test_live_reader_keeps_requests():
    table = HeartbeatTable()
    table.observe(beat("a", 10_000))
    table.mark_complete(11_000)
    assert not table.gone(request("a"))


def test_silent_reader_is_gone_after_missed_beats():
    table = confirmed()
    table.observe(beat("a", 10_000))
    confirm(table, 9_000, 10_000 + SILENCE - 250)
    table.mark_complete(10_000 + SILENCE - 1)
    assert not table.gone(request("a"))
    table.mark_complete(10_000 + SILENCE + 1)
    assert table.gone(request("a"))


def test_stopping_reader_is_gone_at_once():
    table = HeartbeatTable()
    table.observe(beat("a", 10_000, stopping=True))
    table.mark_complete(10_001)
    assert table.gone(request("a"))


def test_replaced_reader_orphans_only_older_requests():
    table = HeartbeatTable()
    table.observe(beat("a", 9_000))
    table.observe(beat("b", 12_000))
    table.mark_complete(12_500)
    assert table.gone(request("a", arrived=10_000))
    # a request of the new process whose first beat we have not seen yet is not orphaned
    table.mark_complete(13_100)
    assert not table.gone(request("c", arrived=13_000))


def test_out_of_order_beats_do_not_roll_back():
    table = HeartbeatTable()
    table.observe(beat("b", 12_000))
    table.observe(beat("a", 9_000))
    assert table.beats[("replies", 0)].incarnation == "b"


def test_unknown_address_and_batch_requests_are_never_orphaned():
    table = HeartbeatTable()
    table.mark_complete(10**12)
    assert not table.gone(request("a"))
    table.observe(beat("a", 0))
    table.mark_complete(10**12)
    assert not table.gone(request(None))
    table.mark_complete(10**12)
    assert not table.gone(request("a", partition=1))


def test_after_an_outage_silence_counts_only_from_the_views_return_plus_a_reconnect_grace():
    """The broker was away from 10 s to 20 s. The view comes back before the ingress process has
    reconnected: its last beat is 10 s old, yet it gets MISSED_BEATS intervals after the grace."""
    table = confirmed()
    table.observe(beat("a", 10_000))
    confirm(table, 9_000, 10_000)
    table.mark_unreachable()  # the watermark calls failed until the broker was back
    back = 20_000
    confirm(table, back, back + RECONNECT_GRACE_MS + SILENCE)
    assert not table.gone(request("a"))
    table.mark_complete(back + RECONNECT_GRACE_MS + SILENCE + 1)
    assert table.gone(request("a"))  # it never came back


def test_a_slow_reader_thread_does_not_restart_the_silence_clock():
    """Confirmations seconds apart because the machine is busy, with the broker answering all along:
    a dead reader is still found after its missed beats, with no reconnect grace."""
    table = confirmed()
    table.observe(beat("a", 10_000))
    table.mark_complete(10_000 + SILENCE - 3_000)
    table.mark_complete(10_000 + SILENCE + 1)  # 3 s without a confirmation: a busy thread, not an outage
    assert table.gone(request("a"))


def test_silence_while_the_view_is_not_known_complete_orphans_nothing():
    """A broker outage: no beat arrives, but the view cannot confirm it has read to the end either,
    so the reader's silence proves nothing until the view is confirmed past its missed beats."""
    table = HeartbeatTable()
    table.observe(beat("a", 10_000))
    assert not table.gone(request("a"))  # never confirmed complete: no verdict on silence
    table.mark_complete(10_500)
    assert not table.gone(request("a"))  # (the wall clock may be far past 15 s here: it is not consulted)
    table.mark_complete(12_000)
    table.mark_complete(11_000)  # an older confirmation never moves the view back
    assert table.complete_as_of_ms == 12_000
    table.observe(beat("a", 14_000))  # beats queued during the outage arrive once it is over
    confirm(table, 12_000, 14_000 + SILENCE)
    assert not table.gone(request("a"))
    table.mark_complete(14_000 + SILENCE + 1)
    assert table.gone(request("a"))


def test_a_client_whose_every_end_query_fails_is_replaced_after_a_bound(monkeypatch):
    """The reader asks the broker through its own client; one that fails every query for good would
    pause every verdict for good (seen after a series of broker restarts: a killed ingress's request
    ran to its end). Past the bound it gets a fresh client, and again each bound while it lasts."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    from gpu_consumers import reply_readers as rr

    class Refusing:
        def bounds(self, *_a, **_k):
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    readers = rr.ReplyReaders.__new__(rr.ReplyReaders)
    rr.HeartbeatTable.__init__(readers)
    readers._lock = threading.Lock()
    readers._ends = Refusing()
    readers._partitions = [TopicPartition("ingress-heartbeats", 0)]
    readers._unconfirmed_since = readers._unanswered_since = None
    replaced = []
    monkeypatch.setattr(readers, "_replace_consumer", lambda: replaced.append(clock[0]))
    clock = [100.0]
    monkeypatch.setattr(rr.time, "monotonic", lambda: clock[0])
    for t in (100.0, 102.0, 104.0, 105.5, 107.0, 110.0, 111.0):
        clock[0] = t
        readers._confirm_complete()
    assert replaced == [105.5, 111.0]
