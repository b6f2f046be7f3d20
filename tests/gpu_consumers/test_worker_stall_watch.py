"""A worker whose loop is stuck in one turn (a client call that does not return, a step that never ends)
keeps its partitions and their requests; the stall watch says so in its log, with every thread's stack,
once per stall."""
from __future__ import annotations

import threading
import time

from gpu_consumers import worker as worker_module
from gpu_consumers.worker import GpuWorker


def watched(monkeypatch, turn_age_s: float):
    dumps: list[float] = []
    monkeypatch.setattr(worker_module, "STALL_DUMP_AFTER_S", 0.05)
    monkeypatch.setattr(worker_module.faulthandler, "dump_traceback",
                        lambda all_threads: dumps.append(time.monotonic()))
    worker = GpuWorker.__new__(GpuWorker)  # the watch alone: no engine, no Kafka
    worker._stop = False
    worker._turn_began = time.monotonic() - turn_age_s
    watch = threading.Thread(target=worker._watch_for_stalls)
    watch.start()
    return worker, watch, dumps


def test_a_turn_past_the_bound_is_dumped_once(monkeypatch, caplog):
    worker, watch, dumps = watched(monkeypatch, turn_age_s=1.0)
    deadline = time.monotonic() + 5
    while not dumps and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # several more checks of the same stuck turn
    worker._stop = True
    watch.join()
    assert len(dumps) == 1
    assert any("worker loop stalled" in r.message for r in caplog.records)


def test_turns_that_keep_beginning_are_not_stalls(monkeypatch):
    worker, watch, dumps = watched(monkeypatch, turn_age_s=0.0)
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        worker._turn_began = time.monotonic()
        time.sleep(0.005)
    worker._stop = True
    watch.join()
    assert dumps == []
