"""When a streams instance must give up and start afresh (pure, no I/O).

The gate is only useful while it releases. Three states leave it holding the scheduler (or
blocking the group that decides who holds it) without releasing, whatever their cause:

* ``rebalancing``: the Faust member has been in a rebalance longer than the bound (a join or
  sync that never completes keeps every instance, standby included, from taking over);
* ``not started``: this instance holds the scheduler partition but its owner loop has not
  started within the bound (a takeover that cannot read the state topic);
* ``stalled``: the owner loop runs but has not completed an iteration within the bound (an
  output Kafka never confirms, a loop that died on an exception, a blocked event loop).

An instance in any of them exits with RECOVERY_EXIT_CODE; its supervisor starts it again and a
standby, if there is one, takes the partition meanwhile. The bound is longer than a routine
broker restart, so a broker that comes back within it does not cost a restart.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Observation:
    """What the instance looks like at one moment (monotonic seconds)."""
    now: float
    rebalancing: bool
    holds_scheduler: bool
    owner_running: bool
    last_iteration_at: float | None  # the owner loop's last completed iteration


class Watchdog:
    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self._rebalancing_since: float | None = None
        self._holding_idle_since: float | None = None

    def verdict(self, o: Observation) -> str | None:
        """None while all is well, else why this instance must exit."""
        self._rebalancing_since = _since(self._rebalancing_since, o.now) if o.rebalancing else None
        if self._rebalancing_since is not None and o.now - self._rebalancing_since > self.bound_s:
            return f"in a rebalance for {o.now - self._rebalancing_since:.0f} s"
        holding_idle = o.holds_scheduler and not o.owner_running and not o.rebalancing
        self._holding_idle_since = _since(self._holding_idle_since, o.now) if holding_idle else None
        if self._holding_idle_since is not None and o.now - self._holding_idle_since > self.bound_s:
            return f"holding the scheduler partition for {o.now - self._holding_idle_since:.0f} s without " \
                   "starting the scheduler"
        if o.owner_running and o.last_iteration_at is not None and o.now - o.last_iteration_at > self.bound_s:
            return f"the scheduler loop has not completed an iteration for {o.now - o.last_iteration_at:.0f} s"
        return None


def _since(started: float | None, now: float) -> float:
    return now if started is None else started
