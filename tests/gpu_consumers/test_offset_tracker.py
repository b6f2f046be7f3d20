from gpu_consumers.offset_tracker import OffsetTracker, decode_done, encode_done


def test_commit_stops_at_the_oldest_request_in_flight_and_lists_finished_ones_above():
    t = OffsetTracker()
    for o in (10, 11, 12, 13):
        t.started(0, o)
    t.done(0, 11)
    t.done(0, 13)
    assert t.committable() == {0: (10, "11,13")}
    t.mark_committed({0: (10, "11,13")})
    assert t.committable() == {}
    t.done(0, 10)
    assert t.committable() == {0: (12, "13")}
    t.done(0, 12)
    assert t.committable() == {0: (14, "")}


def test_the_next_owner_skips_what_the_metadata_says_finished():
    t = OffsetTracker()
    t.adopt(0, 10, "11,13,9")
    assert t.already_done(0, 11) and t.already_done(0, 13)
    assert not t.already_done(0, 10) and not t.already_done(0, 9)
    # while 10 runs, the skipped ones stay listed so a second crash skips them too
    for o in (10, 11, 12, 13):
        t.started(0, o)
    t.done(0, 11)
    t.done(0, 13)
    assert t.committable() == {0: (10, "11,13")}


def test_metadata_is_bounded_and_garbage_tolerant():
    assert len(encode_done(set(range(100_000)))) <= 4000
    assert decode_done("not,numbers") == set()
    assert decode_done(None) == set()


def test_a_failed_commit_is_offered_again_unless_a_newer_one_was_made():
    tracker = OffsetTracker()
    tracker.started(0, 5)
    tracker.done(0, 5)
    first = tracker.committable()
    assert first == {0: (6, "")}
    tracker.mark_committed(first)
    assert tracker.committable() == {}
    tracker.commit_failed(0, first[0])
    assert tracker.committable() == first  # offered again
    tracker.mark_committed(first)
    tracker.started(0, 6)
    tracker.done(0, 6)
    newer = tracker.committable()
    tracker.mark_committed(newer)
    tracker.commit_failed(0, first[0])  # the old one's failure arrives after a newer commit: no effect
    assert tracker.committable() == {}
