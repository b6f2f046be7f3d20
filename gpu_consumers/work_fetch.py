"""How much `work` the loop fetches before its next engine step, and how long it waits for it.

After a step that ended requests the worker waits in the refill window (refill_window.py) for their
successors; idle, it waits briefly for a first request; idle with events awaiting their delivery
reports, it waits on those reports and commits at once.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from gpu_consumers.refill_window import RefillWindow

# How long an idle worker (nothing running, nothing waiting on a grammar) waits for work in one loop turn.
# A fetch returns the moment work arrives, so this adds no latency; it only sets how often the loop's
# Kafka calls run with nothing to do (at 20 ms, 5 % of a core for an idle worker; ~1 % at 100 ms).
IDLE_WAIT_S = 0.1
# Idle with events still awaiting their delivery reports (a request that just ended: its work offset is
# committed only after them, after_delivery.py), the loop waits on those reports, not on work, and commits
# as soon as they come: until that commit a worker killed would have its last request run (and its
# RequestCompleted produced) again by the next owner of the partition.
SETTLING_WAIT_S = 0.02
# Idle but for requests waiting on their grammars: come round quickly for them.
PENDING_WAIT_S = 0.02


class WorkFetch:
    """`work` is what holds the current `work` client (`.consumer`); `commit()` commits what settled."""

    def __init__(self, work: Any, producer: Any, commit: Callable[[], None], refill_window: RefillWindow):
        self.work = work
        self.producer = producer
        self.commit = commit
        self.refill_window = refill_window
        self.ended_last_step = 0
        self.last_step_s = 0.0

    def stepped(self, ended: int, step_s: float) -> None:
        """What the step just run ended, and how long it took: the next fetch's refill window."""
        self.ended_last_step = ended
        self.last_step_s = step_s

    def take(self, room: int, busy: bool, pending: int) -> list:
        """New work for the next step, at most `room` messages; `busy`: the engine has requests to
        step; `pending`: decoded requests still waiting to start."""
        expect, wait = self.refill_window.plan(self.ended_last_step, room, self.last_step_s)
        self.ended_last_step = 0  # one window per step
        planned = expect
        if not busy and len(self.producer) and not pending:
            self.producer.poll(SETTLING_WAIT_S)  # returns at the first delivery report
            self.commit()
            expect, wait = max(expect, 1), 0.0  # then whatever work has arrived meanwhile
        elif not busy:
            expect, wait = max(expect, 1), max(wait, PENDING_WAIT_S if pending else IDLE_WAIT_S)
        msgs = self.fetch(room, wait=wait, expect=expect)
        if planned:
            self.refill_window.observe(planned, len(msgs))
        return msgs

    def fetch(self, limit: int, wait: float, expect: int = 1) -> list:
        """Up to `limit` work messages: waits at most `wait` until `expect` of them are there, then
        takes whatever else has arrived without waiting."""
        got: list = []
        deadline = time.monotonic() + wait
        while len(got) < min(expect, limit):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got.extend(self.work.consumer.consume(num_messages=min(expect, limit) - len(got), timeout=left))
        if len(got) < limit:
            got.extend(self.work.consumer.consume(num_messages=limit - len(got), timeout=0))
        return got
