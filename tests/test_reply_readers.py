from gpu_consumers.reply_readers import HeartbeatTable


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
    table = HeartbeatTable()
    table.observe(beat("a", 10_000))
    table.mark_complete(14_999)
    assert not table.gone(request("a"))
    table.mark_complete(15_001)
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
    table.mark_complete(18_000)
    assert not table.gone(request("a"))
    table.mark_complete(19_001)
    assert table.gone(request("a"))
