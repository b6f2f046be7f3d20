"""The refill window: after a step that ended requests, a busy worker waits briefly for their
successors, and stops waiting where they do not come."""
from __future__ import annotations

import pytest

from gpu_consumers.refill_window import RefillWindow


def test_waits_only_after_a_step_that_ended_requests_and_for_no_more_than_there_is_room_for():
    window = RefillWindow(max_wait_s=0.05)
    assert window.plan(ended=0, room=8, step_s=1.0) == (0, 0.0)
    assert window.plan(ended=3, room=0, step_s=1.0) == (0, 0.0)
    assert window.plan(ended=3, room=8, step_s=1.0) == (3, 0.05)
    assert window.plan(ended=5, room=2, step_s=1.0) == (2, 0.05)
    assert RefillWindow(max_wait_s=0).plan(ended=3, room=8, step_s=1.0) == (0, 0.0)


def test_the_wait_is_held_under_a_fraction_of_the_step_just_run_and_short_steps_get_none():
    window = RefillWindow(max_wait_s=0.05, step_fraction=0.5)
    assert window.plan(ended=2, room=8, step_s=0.06) == (2, 0.03)  # a 60 ms decode step: 30 ms at most
    assert window.plan(ended=2, room=8, step_s=0.3) == (2, 0.05)  # a long prefill step: the cap
    assert window.plan(ended=2, room=8, step_s=0.04) == (0, 0.0)  # shorter than the cap: step at once
    assert window.plan(ended=2, room=8, step_s=0.002) == (0, 0.0)


def test_stops_waiting_where_refills_do_not_come_and_probes_until_they_do():
    window = RefillWindow(max_wait_s=0.05, min_hit_rate=0.2, probe_every=4, smoothing=0.5)
    waits = 0
    for _ in range(20):  # open-loop traffic: nobody fills the ended slots
        expect, wait = window.plan(ended=1, room=4, step_s=1.0)
        if expect:
            waits += 1
            window.observe(expect, arrived=0)
    # a few misses bring the hit rate under the floor; after that only every 4th window waits
    assert window.hit_rate < 0.2
    assert 3 <= waits <= 3 + 20 // 4
    # refills come back: the next probe sees one, and waiting resumes at once
    while window.plan(ended=1, room=4, step_s=1.0)[0] == 0:
        pass
    window.observe(1, arrived=1)
    window.observe(1, arrived=1)
    assert window.hit_rate >= 0.2 and window.plan(ended=1, room=4, step_s=1.0) == (1, 0.05)


def test_rejects_settings_that_cannot_work():
    with pytest.raises(ValueError):
        RefillWindow(max_wait_s=-1)
    with pytest.raises(ValueError):
        RefillWindow(probe_every=0)
