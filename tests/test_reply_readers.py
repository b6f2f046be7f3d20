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
    assert not table.gone(request("a"), now_ms=11_000)


def test_silent_reader_is_gone_after_missed_beats():
    table = HeartbeatTable()
    table.observe(beat("a", 10_000))
    assert not table.gone(request("a"), now_ms=14_999)
    assert table.gone(request("a"), now_ms=15_001)


def test_stopping_reader_is_gone_at_once():
    table = HeartbeatTable()
    table.observe(beat("a", 10_000, stopping=True))
    assert table.gone(request("a"), now_ms=10_001)


def test_replaced_reader_orphans_only_older_requests():
    table = HeartbeatTable()
    table.observe(beat("a", 9_000))
    table.observe(beat("b", 12_000))
    assert table.gone(request("a", arrived=10_000), now_ms=12_500)
    # a request of the new process whose first beat we have not seen yet is not orphaned
    assert not table.gone(request("c", arrived=13_000), now_ms=13_100)


def test_out_of_order_beats_do_not_roll_back():
    table = HeartbeatTable()
    table.observe(beat("b", 12_000))
    table.observe(beat("a", 9_000))
    assert table.beats[("replies", 0)].incarnation == "b"


def test_unknown_address_and_batch_requests_are_never_orphaned():
    table = HeartbeatTable()
    assert not table.gone(request("a"), now_ms=10**12)
    table.observe(beat("a", 0))
    assert not table.gone(request(None), now_ms=10**12)
    assert not table.gone(request("a", partition=1), now_ms=10**12)
