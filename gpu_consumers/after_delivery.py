"""An action held back until the broker has every event produced on its behalf.

A request's `work` offset may only be committed once its last reply and its usage event are
written: committed first, a worker killed in between leaves a client with a truncated stream
that nobody will ever finish (the new owner of the partition starts past it) and a request
nobody bills. Delivery reports arrive from the producer's poll on the worker's own loop, so no
lock is needed.
"""
from __future__ import annotations

import logging
from typing import Callable

from gpu_consumers.offset_tracker import OffsetTracker

log = logging.getLogger(__name__)


class AfterDelivery:
    def __init__(self, what: str, action: Callable[[], None]):
        self._what = what
        self._action = action
        self._outstanding = 0
        self._sealed = False
        self._failed = False

    def expect(self) -> Callable:
        """A delivery callback for one more event the action waits for."""
        self._outstanding += 1
        return self._delivered

    def seal(self) -> None:
        """Nothing more will be produced for it: run the action once the outstanding events are in."""
        self._sealed = True
        self._run_if_settled()

    @property
    def settled(self) -> bool:
        return self._sealed and self._outstanding == 0 and not self._failed

    def _delivered(self, err, _msg=None) -> None:
        self._outstanding -= 1
        if err is not None:
            # Left undone on purpose: the offset stays below this request, so whoever owns the
            # partition next runs it again (identical text; billing keeps one usage per request).
            log.error("%s: an event was not delivered (%s); its work offset stays uncommitted", self._what, err)
            self._failed = True
        self._run_if_settled()

    def _run_if_settled(self) -> None:
        if self.settled:
            self._action()
            self._action = _ran


def _ran() -> None:
    pass


def fan_out(callbacks: list[Callable]) -> Callable | None:
    """One delivery callback for an event several holders wait for (a ReplyBatch ending several requests)."""
    if not callbacks:
        return None
    if len(callbacks) == 1:
        return callbacks[0]

    def delivered(err, msg=None) -> None:
        for callback in callbacks:
            callback(err, msg)
    return delivered


class OffsetSettlements:
    """Each request's `work` offset done (offset_tracker.py) once every event that ends it is
    delivered; `due` says one was since the commit loop last looked, so it commits at once."""

    def __init__(self, offsets: OffsetTracker):
        self.offsets = offsets
        self.due = False

    def settle(self, request_id: str, partition: int, offset: int) -> AfterDelivery:
        def done() -> None:
            self.offsets.done(partition, offset)
            self.due = True
        return AfterDelivery(f"request {request_id} (work partition {partition} offset {offset})", done)
