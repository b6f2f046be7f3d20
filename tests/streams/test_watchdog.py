"""The streams watchdog names every stuck state, and none that is merely slow or idle."""
from streams.watchdog import Observation, Watchdog

BOUND = 10.0


def obs(now, rebalancing=False, holds=True, running=True, last=None):
    return Observation(now=now, rebalancing=rebalancing, holds_scheduler=holds, owner_running=running,
                       last_iteration_at=now if last is None and running else last)


def test_a_healthy_active_instance_and_a_standby_are_never_stuck():
    dog = Watchdog(BOUND)
    for t in range(0, 100):
        assert dog.verdict(obs(float(t))) is None
    standby = Watchdog(BOUND)
    for t in range(0, 100):
        assert standby.verdict(obs(float(t), holds=False, running=False)) is None


def test_a_rebalance_that_never_ends_is_stuck_after_the_bound_but_a_short_one_is_not():
    dog = Watchdog(BOUND)
    for t in range(0, 8):
        assert dog.verdict(obs(float(t), rebalancing=True, holds=False, running=False)) is None
    assert dog.verdict(obs(8.0, holds=False, running=False)) is None  # it ended: the clock restarts
    for t in range(9, 20):
        assert dog.verdict(obs(float(t), rebalancing=True, holds=False, running=False)) is None
    assert "rebalance" in dog.verdict(obs(20.0, rebalancing=True, holds=False, running=False))


def test_holding_the_scheduler_without_starting_it_is_stuck_after_the_bound():
    dog = Watchdog(BOUND)
    for t in range(0, 11):
        assert dog.verdict(obs(float(t), running=False)) is None
    assert "without starting" in dog.verdict(obs(11.0, running=False))


def test_a_loop_that_stopped_completing_iterations_is_stuck_after_the_bound():
    dog = Watchdog(BOUND)
    assert dog.verdict(obs(100.0, last=95.0)) is None
    assert dog.verdict(obs(110.0, last=100.0)) is None
    assert "iteration" in dog.verdict(obs(110.5, last=100.0))
