"""A worker whose loop is stuck in one turn (a client call that does not return, a step that never ends)
keeps its partitions and their requests; the stall watch says so in its log, with every thread's stack,
once per stall."""
from __future__ import annotations

import time

from gpu_consumers import stall_watch
from gpu_consumers.stall_watch import StallWatch


def watched(monkeypatch, turn_age_s: float):
    dumps: list[float] = []
    monkeypatch.setattr(stall_watch.faulthandler, "dump_traceback",
                        lambda all_threads: dumps.append(time.monotonic()))
    watch = StallWatch(after_s=0.05)
    watch.turn_began = time.monotonic() - turn_age_s
    return watch, watch.start(), dumps


def test_a_turn_past_the_bound_is_dumped_once(monkeypatch, caplog):
    watch, thread, dumps = watched(monkeypatch, turn_age_s=1.0)
    deadline = time.monotonic() + 5
    while not dumps and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # several more checks of the same stuck turn
    watch.stop()
    thread.join()
    assert len(dumps) == 1
    assert any("worker loop stalled" in r.message for r in caplog.records)


def test_turns_that_keep_beginning_are_not_stalls(monkeypatch):
    watch, thread, dumps = watched(monkeypatch, turn_age_s=0.0)
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        watch.turn()
        time.sleep(0.005)
    watch.stop()
    thread.join()
    assert dumps == []
