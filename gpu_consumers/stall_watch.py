"""The stall watch: a worker whose loop is stuck in one turn (a client call that does not return, a
step that never ends) keeps its partitions (and their requests) for max.poll.interval.ms; this says
so in its log, with every thread's stack, once per stall."""
from __future__ import annotations

import faulthandler
import logging
import threading
import time

log = logging.getLogger("tokenmill.worker")

# A loop turn (one engine step and its Kafka calls) this long is a stall. Steps take milliseconds to a
# few seconds.
STALL_DUMP_AFTER_S = 30.0


class StallWatch:
    def __init__(self, after_s: float = STALL_DUMP_AFTER_S):
        self.after_s = after_s
        self.turn_began: float | None = None  # when the loop began its current turn
        self.stopped = False

    def turn(self) -> None:
        """The loop begins a turn."""
        self.turn_began = time.monotonic()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.watch, name="tokenmill-stall-watch", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.stopped = True

    def watch(self) -> None:
        """On its own thread: a turn past `after_s` gets one warning and one dump of every thread
        (faulthandler, to stderr: the service's log)."""
        dumped_for = None
        while not self.stopped:
            time.sleep(self.after_s / 10)
            began = self.turn_began
            if began is not None and began != dumped_for and time.monotonic() - began >= self.after_s:
                log.warning("worker loop stalled: one turn has run %.0f s; every thread's stack follows",
                            time.monotonic() - began)
                faulthandler.dump_traceback(all_threads=True)
                dumped_for = began
