"""The fair queue in front of the GPU pool.

Order of release (see docs/schedulers.md for the full story):

1. **Tier.** Interactive before batch; a batch request that has waited
   ``aging.batch_aging_s`` competes in the interactive tier (see priority.py).
2. **Tenant, by Virtual Token Counter (VTC).** Inside a tier, the backlogged tenant
   with the smallest counter goes next (Sheng et al., "Fairness in Serving Large
   Language Models", OSDI 2024). A tenant's counter is the weighted service it has
   received divided by its weight::

       counter += (prompt_tokens * input_weight + output_tokens * output_weight) / weight

   The counter is charged at release with the *estimate* (output = ``max_tokens``)
   because the real output length is unknown until generation ends; ``on_usage``
   later replaces the estimate by the actual numbers. When a tenant becomes backlogged
   after being idle its counter is lifted to the smallest counter among backlogged
   tenants, so idle time is not banked as credit for a later burst. A newcomer lifted
   that way ties with the tenant it was lifted to; a tie goes to the tenant with fewer
   released requests still running per weight, so the newcomer does not lose every
   tie to the tenant that already holds the pool.
3. **FIFO** inside one tenant and one declared class (by enqueue order: a request
   handed back after preemption keeps its original place, see :meth:`FairQueue.requeue`).

The queue is work-conserving: if the best candidate does not fit the capacity on offer,
the next candidate is tried, so capacity never idles while something that fits is
queued. (A large request that never fits is not starved by this: streams offers whole
worker slots, and a slot fits any request the model's context allows.)

Expired requests (deadline passed) are invisible to ``pop_next``; ``shed_expired``
removes them so the caller can answer their clients.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from schedulers.charges import Charge, UnsettledCharges
from schedulers.deadline import DeadlinePolicy
from schedulers.priority import AgingPolicy, PriorityClass, parse_priority
from schedulers.queue_records import QueuedRequest, QueueFull, Release, ShedRequest
from schedulers.tenant_backlog import QueueEntry, TenantBacklog
from schedulers.virtual_counters import VirtualCounters

STATE_VERSION = 1


@dataclass(frozen=True)
class FairQueueConfig:
    # VTC service weights; the paper's default prices an output token at twice an
    # input token because decoding is what occupies the GPU.
    input_weight: float = 1.0
    output_weight: float = 2.0
    max_queued_per_tenant: int = 1000
    max_queued_tokens_per_tenant: int | None = None
    aging: AgingPolicy = field(default_factory=AgingPolicy)
    deadlines: DeadlinePolicy = field(default_factory=DeadlinePolicy)
    # Charges whose usage never arrives (lost event) are forgotten after this long.
    unsettled_ttl_s: float = 3600.0

    def weighted_tokens(self, prompt_tokens: float, output_tokens: float) -> float:
        return prompt_tokens * self.input_weight + output_tokens * self.output_weight


CanStart = Callable[[QueuedRequest], bool]


class FairQueue:
    def __init__(self, config: FairQueueConfig | None = None) -> None:
        self.config = config or FairQueueConfig()
        self._backlogs: dict[str, TenantBacklog] = {}
        self._where: dict[str, str] = {}  # request_id -> tenant_id, for remove()
        self._vtc = VirtualCounters(self._backlogs)
        self._next_seq = 0
        self._charges = UnsettledCharges()
        # A lazy min-heap, so no per-request operation scans every queued request (a gate with
        # 1,000 tenants spent most of its time doing that). An entry is stale once its request left;
        # stale entries are skipped when they surface, and the heap is rebuilt when they outnumber
        # the live ones.
        self._deadlines: list[tuple[float, int, str]] = []  # (deadline, seq, queued request id)

    # ---------------------------------------------------------------- enqueue

    def enqueue(self, request: QueuedRequest, *, max_queued: int | None = None) -> bool:
        """Queue a request. Returns ``False`` (and changes nothing) if a request with
        this id is already queued, so a redelivered Kafka record is harmless.
        Raises :class:`QueueFull` when the tenant is at its cap; ``max_queued``
        overrides the configured per-tenant request cap for this tenant."""
        if request.request_id in self._where:
            return False
        backlog = self._backlogs.get(request.tenant_id)
        depth = len(backlog) if backlog else 0
        cap = self.config.max_queued_per_tenant if max_queued is None else max_queued
        if depth >= cap:
            raise QueueFull(request.tenant_id, "requests", depth, cap)
        token_cap = self.config.max_queued_tokens_per_tenant
        queued_tokens = backlog.queued_tokens if backlog else 0
        if token_cap is not None and queued_tokens + request.cost_tokens > token_cap:
            raise QueueFull(request.tenant_id, "tokens", queued_tokens, token_cap)

        if depth == 0:
            self._vtc.lift(request.tenant_id)
            backlog = self._backlogs.setdefault(request.tenant_id, TenantBacklog())
        assert backlog is not None  # a tenant with a depth has a backlog
        self._add_entry(backlog, QueueEntry(request, self._next_seq))
        self._next_seq += 1
        return True

    def _add_entry(self, backlog: TenantBacklog, entry: QueueEntry) -> None:
        request = entry.request
        newly_waiting = not len(backlog)
        backlog.add(entry)
        self._where[request.request_id] = request.tenant_id
        if newly_waiting:
            self._vtc.note_waiting(request.tenant_id)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, entry.seq, request.request_id))
            if len(self._deadlines) > 4 * len(self._where) + 1024:
                self._deadlines = [(e.request.deadline, e.seq, e.request.request_id)
                                   for b in self._backlogs.values() for e in b.entries()
                                   if e.request.deadline is not None]
                heapq.heapify(self._deadlines)

    # ---------------------------------------------------------------- release

    def pop_next(self, now: float, can_start: CanStart | None = None) -> Release | None:
        """Release the best candidate that fits the capacity on offer (``can_start``; None:
        unlimited), or ``None`` if nothing queued may start."""
        return next(self.releases(now, can_start), None)

    def releases(self, now: float, can_start: CanStart | None = None) -> Iterator[Release]:
        """Release, one at a time, what ``pop_next`` would release if called until it returns
        ``None``, in the same order, at O(log tenants) a release instead of a sort per release.

        Lazy: each next release is chosen when it is asked for, so ``can_start`` sees the capacity
        the previous releases used. Within one round a request ``can_start`` refused must stay
        refused (capacity on offer only shrinks as releases use it), and the queue must not be
        changed other than through this iterator until it is done.
        """
        # Only the released tenant's counter and running count change between two releases, so
        # every other tenant's heads keep their rank; the released tenant's heads are ranked again
        # under a new version, which makes its older heap entries stale.
        version: dict[str, int] = {}
        heap = [self._ranked(tenant_id, tier, entry, 0) for tenant_id, backlog in self._backlogs.items()
                for tier, entry in backlog.tier_heads(self.config.aging, now)]
        heapq.heapify(heap)
        while heap:
            *_, stamp, tier, entry = heapq.heappop(heap)
            request = entry.request
            if stamp != version.get(request.tenant_id, 0) or request.request_id not in self._where:
                continue
            if can_start is not None and not can_start(request):
                continue
            release = self._release(entry, tier, now)
            stamp = version[request.tenant_id] = stamp + 1
            backlog = self._backlogs.get(request.tenant_id)
            if backlog is not None:
                for tier, head in backlog.tier_heads(self.config.aging, now):
                    heapq.heappush(heap, self._ranked(request.tenant_id, tier, head, stamp))
            yield release

    def _ranked(self, tenant_id: str, tier: PriorityClass, entry: QueueEntry, stamp: int) -> tuple:
        """A head's place in release order: tier, VTC counter, running per weight, FIFO (seq is
        unique, so comparison never reaches the stamp or the entry)."""
        # Read the two dicts directly: this runs for every head of every release round.
        return (tier.rank, self._vtc.by_tenant.get(tenant_id, 0.0),
                self._charges.running.get(tenant_id, 0) / entry.request.weight, entry.seq, stamp, tier, entry)

    def _candidates(self, now: float) -> list[tuple[PriorityClass, QueueEntry]]:
        """Every tenant's eligible head per tier, best first."""
        running, counters = self._charges.running, self._vtc.by_tenant
        ranked: list[tuple[int, float, float, int, PriorityClass, QueueEntry]] = []
        for tenant_id, backlog in self._backlogs.items():
            counter = counters.get(tenant_id, 0.0)
            for tier, entry in backlog.tier_heads(self.config.aging, now):
                ranked.append((tier.rank, counter, running.get(tenant_id, 0) / entry.request.weight, entry.seq,
                               tier, entry))
        ranked.sort(key=lambda r: r[:4])
        return [(r[4], r[5]) for r in ranked]

    def heads(self, now: float) -> list[tuple[PriorityClass, QueuedRequest]]:
        """Every tenant's eligible head per tier, in the order :meth:`pop_next` would try them."""
        return [(tier, entry.request) for tier, entry in self._candidates(now)]

    def pop_request(self, request_id: str, now: float) -> Release | None:
        """Release this queued request now, charged like any release (the slot was freed for it)."""
        tenant_id = self._where.get(request_id)
        if tenant_id is None:
            return None
        for tier, entry in self._backlogs[tenant_id].tier_heads(self.config.aging, now):
            if entry.request.request_id == request_id:
                return self._release(entry, tier, now)
        return None  # no longer a head (expired, or its tenant's FIFO moved): leave it to pop_next

    def requeue(self, request: QueuedRequest, seq: int) -> None:
        """Put a request back at its original place (``seq``) in its tenant's FIFO, e.g. a
        preempted one: it stays ahead of that tenant's newer work."""
        if request.request_id in self._where:
            return
        # No counter lift: the tenant was not idle, its request was running.
        backlog = self._backlogs.setdefault(request.tenant_id, TenantBacklog())
        self._add_entry(backlog, QueueEntry(request, seq))
        fifo = backlog.by_class[request.priority]
        ordered = sorted(fifo.values(), key=lambda e: e.seq)
        fifo.clear()
        fifo.update((e.request.request_id, e) for e in ordered)

    def _release(self, entry: QueueEntry, tier: PriorityClass, now: float) -> Release:
        req = entry.request
        weighted = self.config.weighted_tokens(req.prompt_tokens, req.max_tokens)
        self._vtc.add(req.tenant_id, weighted / req.weight)
        # Charge before taking out: if this drains the queue, the floor must include it.
        self._take_out(req)
        if req.tenant_id in self._backlogs:
            self._vtc.note_waiting(req.tenant_id)
        charge = Charge(req.request_id, req.tenant_id, weighted, req.weight, now)
        self._charges.add(charge)
        return Release(req, charge, tier, entry.seq)

    def _take_out(self, req: QueuedRequest) -> None:
        backlog = self._backlogs[req.tenant_id]
        backlog.discard(req)
        del self._where[req.request_id]
        if not len(backlog):
            del self._backlogs[req.tenant_id]
            if not self._backlogs:
                self._vtc.drained_by(req.tenant_id)

    # ---------------------------------------------------------------- usage

    def on_usage(self, tenant_id: str, prompt_tokens: int, completion_tokens: int, estimated: Charge) -> float:
        """Replace the estimate charged at release by the actual usage.

        Returns the correction applied to the tenant's counter (negative when the
        completion was shorter than ``max_tokens``). A second call for the same
        charge, or one for a charge this queue never made, changes nothing and
        returns 0.0, so duplicated usage events are harmless. To refund a request
        that failed before doing any work, pass zero tokens.
        """
        if self._charges.get(estimated.request_id) != estimated or estimated.tenant_id != tenant_id:
            return 0.0
        self._charges.drop(estimated.request_id)
        actual = self.config.weighted_tokens(prompt_tokens, completion_tokens)
        delta = (actual - estimated.weighted_tokens) / estimated.weight
        self._vtc.add(tenant_id, delta)
        if tenant_id in self._backlogs:
            self._vtc.note_waiting(tenant_id)
        return delta

    # ---------------------------------------------------------------- removal

    def remove(self, request_id: str) -> QueuedRequest | None:
        """Cancel a queued request. Returns it, or ``None`` if it is not queued
        (already released, shed, or unknown)."""
        tenant_id = self._where.get(request_id)
        if tenant_id is None:
            return None
        backlog = self._backlogs[tenant_id]
        for fifo in backlog.by_class.values():
            entry = fifo.get(request_id)
            if entry is not None:
                self._take_out(entry.request)
                return entry.request
        raise AssertionError("index and backlog disagree")  # pragma: no cover

    def shed_expired(self, now: float) -> list[ShedRequest]:
        """Remove and return, oldest first, every request that is past its deadline."""
        policy = self.config.deadlines
        doomed: list[tuple[int, ShedRequest]] = []
        heap = self._deadlines
        while heap:
            deadline, seq, request_id = heap[0]
            reason = policy.shed_reason(deadline, now)
            if reason is None:
                break  # the earliest deadline left is still ahead, and so are all the others
            heapq.heappop(heap)
            tenant_id = self._where.get(request_id)
            if tenant_id is None:
                continue  # released or removed since
            for fifo in self._backlogs[tenant_id].by_class.values():
                entry = fifo.get(request_id)
                if entry is not None and entry.seq == seq:
                    doomed.append((seq, ShedRequest(entry.request, reason)))
                    self._take_out(entry.request)
        doomed.sort(key=lambda d: d[0])
        self._charges.forget_stale(now, self.config.unsettled_ttl_s)
        return [shed for _, shed in doomed]

    # ---------------------------------------------------------------- inspection

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._where

    def depth(self, tenant_id: str | None = None, priority: PriorityClass | str | None = None) -> int:
        """Queued requests, optionally for one tenant and/or one declared class."""
        cls = None if priority is None else parse_priority(priority)
        if tenant_id is not None and cls is None:
            backlog = self._backlogs.get(tenant_id)
            return len(backlog) if backlog is not None else 0
        total = 0
        for t, backlog in self._backlogs.items():
            if tenant_id is not None and t != tenant_id:
                continue
            for p, fifo in backlog.by_class.items():
                if cls is None or p is cls:
                    total += len(fifo)
        return total

    def depths(self) -> dict[str, dict[str, int]]:
        """``{tenant: {class: n}}`` for every backlogged tenant (for metrics)."""
        return {
            t: {p.value: len(fifo) for p, fifo in b.by_class.items()}
            for t, b in self._backlogs.items()
        }

    def next_seq(self) -> int:
        """A place behind everything queued so far."""
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def running(self) -> dict[str, int]:
        """Released requests not yet settled, per tenant."""
        return dict(self._charges.running)

    def counter(self, tenant_id: str) -> float:
        """The tenant's virtual token counter (weighted service / weight)."""
        return self._vtc.of(tenant_id)

    def queued(self) -> list[QueuedRequest]:
        """All queued requests in enqueue order."""
        entries = [e for b in self._backlogs.values() for e in b.entries()]
        return [e.request for e in sorted(entries, key=lambda e: e.seq)]

    # ---------------------------------------------------------------- persistence

    def seq_of(self, request_id: str) -> int:
        """A queued request's place in enqueue order, as ``to_dict`` saves it with the request."""
        tenant_id = self._where[request_id]
        for fifo in self._backlogs[tenant_id].by_class.values():
            entry = fifo.get(request_id)
            if entry is not None:
                return entry.seq
        raise KeyError(request_id)

    def globals_state(self) -> dict[str, Any]:
        """The part of ``to_dict`` that is about no one request: next seq, floor and counters."""
        return {"floor": self._vtc.floor, "next_seq": self._next_seq, "counters": dict(self._vtc.by_tenant)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible state. Restoring it with :meth:`from_dict` gives a queue
        that makes exactly the same decisions."""
        entries = sorted((e for b in self._backlogs.values() for e in b.entries()), key=lambda e: e.seq)
        return {
            "version": STATE_VERSION,
            "next_seq": self._next_seq,
            "floor": self._vtc.floor,
            "counters": dict(self._vtc.by_tenant),
            "requests": [{**e.request.to_dict(), "seq": e.seq} for e in entries],
            "unsettled": [c.to_dict() for c in self._charges],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], config: FairQueueConfig | None = None) -> FairQueue:
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported fair queue state version {data.get('version')!r}")
        queue = cls(config)
        queue._next_seq = int(data["next_seq"])
        queue._vtc.floor = float(data["floor"])
        queue._vtc.by_tenant = {t: float(c) for t, c in data["counters"].items()}
        for item in sorted(data["requests"], key=lambda r: r["seq"]):
            request = QueuedRequest.from_dict(item)
            entry = QueueEntry(request, int(item["seq"]))  # an older state's "bypassed" is ignored
            queue._add_entry(queue._backlogs.setdefault(request.tenant_id, TenantBacklog()), entry)
        for c in data["unsettled"]:
            queue._charges.add(Charge.from_dict(c))
        return queue
