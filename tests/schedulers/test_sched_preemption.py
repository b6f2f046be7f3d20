"""The preemption policy: who is owed a slot, who gives one up, and no ping-pong."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.preemption import PreemptionPolicy, RunningSequence, WaitingRequest
from schedulers.priority import PriorityClass

I, B = PriorityClass.INTERACTIVE, PriorityClass.BATCH


def run(tenant, n, tier=I, weight=1.0, start=0.0, prefix=None):
    return [RunningSequence(f"{prefix or tenant}-run-{i}", tenant, tier, weight, start + i) for i in range(n)]


def wait(tenant, i=0, tier=I, weight=1.0):
    return WaitingRequest(f"{tenant}-wait-{i}", tenant, tier, weight)


def test_a_flooding_tenant_gives_its_newest_slot_to_a_waiting_tenant():
    decided = PreemptionPolicy().decide(run("a", 4), [wait("b")], free_slots=0, pending_for=set(), now=100.0)
    assert [(p.victim.request_id, p.beneficiary.request_id, p.reason) for p in decided] == [
        ("a-run-3", "b-wait-0", "fairness")]


def test_no_preemption_when_a_slot_is_free_or_nobody_else_waits():
    policy = PreemptionPolicy()
    assert policy.decide(run("a", 4), [wait("b")], free_slots=1, pending_for=set(), now=1.0) == []
    # work-conserving: the flooder's own backlog never preempts the flooder
    assert policy.decide(run("a", 4), [wait("a", i) for i in range(10)], 0, set(), 1.0) == []


def test_moves_slots_only_up_to_the_fair_share():
    decided = PreemptionPolicy().decide(run("a", 4), [wait("b", i) for i in range(4)], 0, set(), 1.0)
    assert len(decided) == 2  # 2 of 4 slots each; a third move would make b the better served


def test_weights_decide_the_share():
    decided = PreemptionPolicy().decide(run("a", 8, weight=3.0), [wait("b", i) for i in range(8)], 0, set(), 1.0)
    assert len(decided) == 2  # b's weight is a quarter of the total: 2 of 8 slots


def test_a_pending_preemption_is_not_requested_twice():
    policy = PreemptionPolicy()
    waiting = [wait("b", 0), wait("b", 1), wait("b", 2)]
    first = policy.decide(run("a", 4), waiting[:1], 0, set(), 1.0)
    assert len(first) == 1
    running = [s for s in run("a", 4) if s.request_id != first[0].victim.request_id]
    again = policy.decide(running, waiting, 0, {"b-wait-0"}, 1.5)
    assert len(again) == 1 and again[0].beneficiary.request_id == "b-wait-1"


def test_interactive_preempts_batch_even_of_its_own_tenant_and_batch_never_preempts_interactive():
    policy = PreemptionPolicy()
    decided = policy.decide(run("a", 4, tier=B), [wait("a", tier=I)], 0, set(), 1.0)
    assert [(p.victim.tenant_id, p.reason) for p in decided] == [("a", "priority")]
    assert policy.decide(run("a", 4, tier=B), [wait("b", tier=B)], 0, set(), 1.0) != []  # fairness among batch
    assert policy.decide(run("a", 1, tier=I) + run("b", 3, tier=I), [wait("b", 9, tier=B)], 0, set(), 1.0) == []


def test_a_batch_waiter_takes_only_batch_slots():
    decided = PreemptionPolicy().decide(run("a", 4, tier=I), [wait("b", tier=B)], 0, set(), 1.0)
    assert decided == []


def test_unpreemptible_sequences_are_left_alone():
    running = [RunningSequence("a-0", "a", I, 1.0, 0.0, preemptible=False)] * 1 + run("a", 0)
    assert PreemptionPolicy().decide(running, [wait("b")], 0, set(), 1.0) == []


tenants = st.sampled_from(["a", "b", "c"])


@settings(max_examples=200, deadline=None)
@given(
    weights=st.fixed_dictionaries({"a": st.sampled_from([1.0, 2.0, 3.0]), "b": st.sampled_from([1.0, 2.0]),
                                   "c": st.just(1.0)}),
    initial=st.lists(tenants, min_size=1, max_size=12),
    arrivals=st.lists(st.lists(tenants, max_size=4), min_size=1, max_size=8),
)
def test_simulated_rounds_never_ping_pong_and_respect_weights(weights, initial, arrivals):
    """Rounds of a full pool: new requests arrive, the policy moves slots, the moves are applied.
    A slot taken from X for Y is never taken back from Y for X within the hysteresis window,
    and nobody is pushed below its weighted share of the pool by a move."""
    policy = PreemptionPolicy(hysteresis_s=5.0, max_per_round=100)
    running = [RunningSequence(f"r{i}", t, I, weights[t], float(i)) for i, t in enumerate(initial)]
    waiting: list[WaitingRequest] = []
    moved_at: dict[tuple[str, str], float] = {}
    counter = 0
    for round_no, arrived in enumerate(arrivals):
        now = float(round_no)
        for tenant in arrived:
            counter += 1
            waiting.append(WaitingRequest(f"w{counter}", tenant, I, weights[tenant]))
        decided = policy.decide(running, waiting, 0, set(), now)
        for p in decided:
            donor, receiver = p.victim.tenant_id, p.beneficiary.tenant_id
            assert donor != receiver
            back = moved_at.get((receiver, donor))
            assert back is None or now - back >= 5.0, "a slot was taken back within the hysteresis window"
            moved_at[(donor, receiver)] = now
            running.remove(p.victim)
            waiting.remove(p.beneficiary)
            running.append(RunningSequence(p.beneficiary.request_id, receiver, I, weights[receiver], now + 0.5))
            held = {t: sum(1 for s in running if s.tenant_id == t) for t in weights}
            # right after its move, the donor is still at least as served, per weight, as the receiver
            assert held[donor] / weights[donor] >= held[receiver] / weights[receiver] - 1e-9
        assert len(running) == len(initial)  # slots move, none appear or vanish


@settings(max_examples=100, deadline=None)
@given(initial=st.lists(tenants, min_size=1, max_size=12), waiting_tenants=st.lists(tenants, max_size=6),
       free=st.integers(min_value=0, max_value=3))
def test_work_conserving(initial, waiting_tenants, free):
    """Nothing is preempted for a waiter a free slot already covers, nor while only one tenant is active."""
    running = [RunningSequence(f"r{i}", t, I, 1.0, float(i)) for i, t in enumerate(initial)]
    waiting = [WaitingRequest(f"w{i}", t, I, 1.0) for i, t in enumerate(waiting_tenants)]
    decided = PreemptionPolicy(max_per_round=100).decide(running, waiting, free, set(), 1.0)
    assert len(decided) <= max(0, len(waiting) - free)
    if len(set(initial) | set(waiting_tenants)) == 1:
        assert decided == []
    assert {p.beneficiary.request_id for p in decided}.isdisjoint({w.request_id for w in waiting[:free]})
