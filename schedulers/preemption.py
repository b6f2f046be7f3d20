"""Which running sequence to preempt, and for whom, when the pool is full.

The fair queue decides who starts next, but only when a slot frees. With long
generations a tenant that filled every slot keeps them for a whole generation, so
a newcomer waits for the flood's next wave however well the queue orders it. This
policy moves slots instead: when a queued request cannot start because no credit is
free, one running sequence is taken (preempted by recompute) from the tenant that is
served most, and its slot goes to the waiting request.

Two reasons, checked in this order for each waiting head (in the queue's own release
order):

* ``priority``: an interactive-tier request waits while a batch-tier sequence runs.
  The victim is a batch sequence of the tenant holding most batch slots per weight.
* ``fairness``: the waiting request's tenant holds fewer slots than its weighted
  share of the slots in use. The victim's tenant is the one holding most slots per
  weight, and only if, after the move, it still holds at least as many slots per
  weight as the receiver (``(r_v - 1) / w_v >= (r_t + 1) / w_t``). That inequality is
  what prevents ping-pong: the move can never make the receiver the better-served
  of the two, so the donor cannot claim the slot straight back. On top of it, a
  tenant that lost a slot to another tenant cannot take one back from that tenant
  for ``hysteresis_s`` (weights or shares that change meanwhile cannot flip it
  back and forth either).

Inside the victim tenant, the most recently started sequence goes (least work
thrown away, as in vLLM's recompute preemption); batch before interactive.

The policy is work-conserving by construction: it only acts while a request waits
and no credit is free, so a lone flooding tenant keeps every slot. Each waiting
request has at most one preemption pending for it, and a slot already being freed
counts as free, so one slow worker does not cause a cascade of preemptions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from schedulers.priority import PriorityClass


@dataclass(frozen=True)
class RunningSequence:
    """A released request that holds a slot (or is on its way to one)."""

    request_id: str
    tenant_id: str
    tier: PriorityClass
    weight: float
    started_at: float
    preemptible: bool = True


@dataclass(frozen=True)
class WaitingRequest:
    """A queue head that could start now if a slot were free."""

    request_id: str
    tenant_id: str
    tier: PriorityClass
    weight: float


@dataclass(frozen=True)
class Preemption:
    victim: RunningSequence
    beneficiary: WaitingRequest
    reason: str  # "fairness" or "priority"


@dataclass
class PreemptionPolicy:
    hysteresis_s: float = 10.0
    max_per_round: int = 8
    # (tenant that lost a slot, tenant that received it) -> when
    _moves: dict[tuple[str, str], float] = field(default_factory=dict)

    def decide(
        self,
        running: list[RunningSequence],
        waiting: list[WaitingRequest],
        free_slots: int,
        pending_for: set[str],
        now: float,
    ) -> list[Preemption]:
        """Preemptions to request now, for one model's pool.

        ``waiting`` is in the queue's release order. ``free_slots`` is the credit free
        now: that many waiting heads are served without preempting anything.
        ``pending_for`` holds the waiting requests that already have a preemption on
        the way; ``running`` must not hold the victims of those.
        """
        self._forget(now)
        if not waiting or not running:
            return []
        slots: dict[str, float] = {}
        weights: dict[str, float] = {}
        for seq in running:
            slots[seq.tenant_id] = slots.get(seq.tenant_id, 0) + 1
            weights[seq.tenant_id] = seq.weight
        for req in waiting:
            weights.setdefault(req.tenant_id, req.weight)
        # batch first, then newest first; among equal start times, the later in `running` is newer
        candidates = [s for _, s in sorted(((i, s) for i, s in enumerate(running) if s.preemptible),
                                           key=lambda e: (e[1].tier is PriorityClass.INTERACTIVE,
                                                          -e[1].started_at, -e[0]))]
        taken: set[str] = set()
        decided: list[Preemption] = []
        uncovered = free_slots
        # Kept as the loop goes rather than recounted for each waiting head: with a thousand
        # tenants waiting, recounting made a round quadratic (the gate spent most of its time here).
        pool = _PoolView(slots, weights, sum(1 for s in candidates if s.tier is PriorityClass.BATCH))
        for req in waiting:
            if len(decided) >= self.max_per_round:
                break
            if req.request_id in pending_for:
                pool.add_slot(req.tenant_id)  # its slot is on the way
                continue
            if uncovered > 0:
                uncovered -= 1  # a free (or freeing) slot will serve this one
                pool.add_slot(req.tenant_id)
                continue
            pick = self._victim(req, candidates, taken, pool, now)
            if pick is None:
                continue
            victim, reason = pick
            taken.add(victim.request_id)
            pool.move_slot(victim, req.tenant_id)
            if victim.tenant_id != req.tenant_id:
                self._moves[(victim.tenant_id, req.tenant_id)] = now
            decided.append(Preemption(victim, req, reason))
        return decided

    def _victim(self, req: WaitingRequest, candidates: list[RunningSequence], taken: set[str],
                pool: "_PoolView", now: float) -> tuple[RunningSequence, str] | None:
        slots, weights = pool.slots, pool.weights
        if req.tier is PriorityClass.INTERACTIVE and pool.batch_candidates:
            batch = [s for s in candidates if s.request_id not in taken and s.tier is PriorityClass.BATCH
                     and not self._blocked(s.tenant_id, req.tenant_id, now)]
            if batch:
                per_weight = {s.tenant_id: slots[s.tenant_id] / weights[s.tenant_id] for s in batch}
                tenant = max(per_weight, key=lambda t: (per_weight[t], t == req.tenant_id, t))
                return next(s for s in batch if s.tenant_id == tenant), "priority"
        mine = slots.get(req.tenant_id, 0)
        share = pool.total * weights[req.tenant_id] / pool.active_weight
        if mine >= share:
            return None
        receiver_after = (mine + 1) / weights[req.tenant_id]
        if pool.most_after_giving_one() < receiver_after:
            return None  # no tenant holds enough slots to give one up to this one
        best: RunningSequence | None = None
        best_load = -1.0
        free = (s for s in candidates if s.request_id not in taken)
        for seq in free:
            if seq.tenant_id == req.tenant_id or self._blocked(seq.tenant_id, req.tenant_id, now):
                continue
            if req.tier is PriorityClass.BATCH and seq.tier is PriorityClass.INTERACTIVE:
                continue  # batch work never displaces interactive work
            load = slots[seq.tenant_id] / weights[seq.tenant_id]
            if (slots[seq.tenant_id] - 1) / weights[seq.tenant_id] < receiver_after:
                continue
            if load > best_load:  # candidates are in victim order, so the first of a tenant wins
                best, best_load = seq, load
        return (best, "fairness") if best is not None else None

    def _blocked(self, victim_tenant: str, beneficiary_tenant: str, now: float) -> bool:
        """The victim's tenant received a slot from the beneficiary's tenant too recently."""
        at = self._moves.get((beneficiary_tenant, victim_tenant))
        return at is not None and now - at < self.hysteresis_s

    def _forget(self, now: float) -> None:
        for key in [k for k, at in self._moves.items() if now - at >= self.hysteresis_s]:
            del self._moves[key]


class _PoolView:
    """Slots per tenant during one ``decide`` round, with the sums the decisions need kept up
    to date as slots move (one waiting head after another), instead of recounted per head."""

    def __init__(self, slots: dict[str, float], weights: dict[str, float], batch_candidates: int) -> None:
        self.slots, self.weights = slots, weights
        self.total = sum(slots.values())
        self.active_weight = sum(weights.values())
        self.batch_candidates = batch_candidates
        self._most: float | None = None  # max over tenants of (slots - 1) / weight; None: recount

    def add_slot(self, tenant_id: str) -> None:
        self.slots[tenant_id] = self.slots.get(tenant_id, 0) + 1
        self.total += 1
        if self._most is not None:
            self._most = max(self._most, self._after_giving_one(tenant_id))

    def move_slot(self, victim: RunningSequence, to_tenant: str) -> None:
        self.slots[victim.tenant_id] -= 1
        self.slots[to_tenant] = self.slots.get(to_tenant, 0) + 1
        if victim.tier is PriorityClass.BATCH:
            self.batch_candidates -= 1
        self._most = None  # a tenant lost a slot: the maximum may have dropped

    def most_after_giving_one(self) -> float:
        """An upper bound on what any donor would keep per weight after giving a slot up."""
        if self._most is None:
            self._most = max((self._after_giving_one(t) for t in self.slots), default=float("-inf"))
        return self._most

    def _after_giving_one(self, tenant_id: str) -> float:
        return (self.slots[tenant_id] - 1) / self.weights[tenant_id]
