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

from schedulers.deadline import DeadlinePolicy, ShedReason
from schedulers.priority import AgingPolicy, PriorityClass, parse_priority

STATE_VERSION = 1


@dataclass(frozen=True)
class QueuedRequest:
    """One request waiting for GPU capacity. ``payload`` is opaque to the queue
    (it must be JSON-serialisable if the queue state is persisted)."""

    request_id: str
    tenant_id: str
    priority: PriorityClass
    prompt_tokens: int
    max_tokens: int
    enqueued_at: float
    weight: float = 1.0
    deadline: float | None = None
    payload: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority", parse_priority(self.priority))
        if self.prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not self.weight > 0:
            raise ValueError("tenant weight must be > 0")

    @property
    def cost_tokens(self) -> int:
        """Token cost estimate used for capacity: the whole prompt plus the longest
        possible completion."""
        return self.prompt_tokens + self.max_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "priority": self.priority.value,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "enqueued_at": self.enqueued_at,
            "weight": self.weight,
            "deadline": self.deadline,
            "payload": self.payload,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QueuedRequest:
        return cls(**{k: data[k] for k in _REQUEST_FIELDS if k in data})


_REQUEST_FIELDS = (
    "request_id", "tenant_id", "priority", "prompt_tokens", "max_tokens",
    "enqueued_at", "weight", "deadline", "payload",
)


@dataclass(frozen=True)
class Charge:
    """What a tenant's counter was charged when its request was released.

    It travels with the work (put it in the work message) and comes back to
    :meth:`FairQueue.on_usage`, which needs both the estimate and the weight used, so
    the correction is exact even if the tenant's weight changed meanwhile.
    """

    request_id: str
    tenant_id: str
    weighted_tokens: float
    weight: float
    released_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "weighted_tokens": self.weighted_tokens,
            "weight": self.weight,
            "released_at": self.released_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Charge:
        return cls(**data)


@dataclass(frozen=True)
class Release:
    """The result of :meth:`FairQueue.pop_next`: the request, what was charged for it,
    and the tier it won in (``interactive`` for an aged batch request)."""

    request: QueuedRequest
    charge: Charge
    tier: PriorityClass
    seq: int = -1  # its place in enqueue order (where it goes back if it is preempted)


@dataclass(frozen=True)
class ShedRequest:
    request: QueuedRequest
    reason: ShedReason


class QueueFull(Exception):
    """The tenant's queue is at its cap; the edge should answer 429 at once."""

    def __init__(self, tenant_id: str, kind: str, depth: int, limit: int) -> None:
        super().__init__(f"queue full for tenant {tenant_id!r}: {kind} {depth} >= limit {limit}")
        self.tenant_id = tenant_id
        self.kind = kind  # "requests" or "tokens"
        self.depth = depth
        self.limit = limit


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


@dataclass
class _Entry:
    request: QueuedRequest
    seq: int  # global enqueue order; gives FIFO and deterministic tie-breaks


class _TenantBacklog:
    """One tenant's queued requests, one FIFO per declared class.

    Plain dicts keep insertion order, which is enqueue order, and give O(1) removal
    by id for cancellations.
    """

    def __init__(self) -> None:
        self.by_class: dict[PriorityClass, dict[str, _Entry]] = {p: {} for p in PriorityClass}
        self.queued_tokens = 0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, entry: _Entry) -> None:
        self.by_class[entry.request.priority][entry.request.request_id] = entry
        self.queued_tokens += entry.request.cost_tokens
        self.count += 1

    def discard(self, request: QueuedRequest) -> None:
        del self.by_class[request.priority][request.request_id]
        self.queued_tokens -= request.cost_tokens
        self.count -= 1

    def entries(self) -> Iterator[_Entry]:
        for q in self.by_class.values():
            yield from q.values()


class FairQueue:
    def __init__(self, config: FairQueueConfig | None = None) -> None:
        self.config = config or FairQueueConfig()
        self._backlogs: dict[str, _TenantBacklog] = {}
        self._where: dict[str, str] = {}  # request_id -> tenant_id, for remove()
        self._counters: dict[str, float] = {}
        # Counter of the last tenant to leave when the whole queue drained: the lift
        # target for a tenant arriving at an empty queue (VTC keeps this so a tenant
        # cannot gain by arriving while nobody else is queued).
        self._floor = 0.0
        self._next_seq = 0
        self._unsettled: dict[str, Charge] = {}
        # Unsettled charges per tenant, kept with _unsettled: every release consults it, and
        # recounting _unsettled there cost O(requests in flight) per release.
        self._running: dict[str, int] = {}
        # Lazy min-heaps, so no per-request operation scans every tenant or every queued request
        # (a gate with 1,000 tenants spent most of its time doing that). An entry is stale once
        # what it records has changed; stale entries are skipped when they surface, and the
        # heap is rebuilt when they outnumber the live ones.
        self._waiting_counters: list[tuple[float, str]] = []  # (counter, backlogged tenant)
        self._deadlines: list[tuple[float, int, str]] = []  # (deadline, seq, queued request id)
        self._charges_checked_at: float | None = None

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
            self._lift_counter(request.tenant_id)
            backlog = self._backlogs.setdefault(request.tenant_id, _TenantBacklog())
        assert backlog is not None  # a tenant with a depth has a backlog
        self._add_entry(backlog, _Entry(request, self._next_seq))
        self._next_seq += 1
        return True

    def _add_entry(self, backlog: _TenantBacklog, entry: _Entry) -> None:
        request = entry.request
        newly_waiting = not len(backlog)
        backlog.add(entry)
        self._where[request.request_id] = request.tenant_id
        if newly_waiting:
            self._note_counter(request.tenant_id)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, entry.seq, request.request_id))
            if len(self._deadlines) > 4 * len(self._where) + 1024:
                self._deadlines = [(e.request.deadline, e.seq, e.request.request_id)
                                   for b in self._backlogs.values() for e in b.entries()
                                   if e.request.deadline is not None]
                heapq.heapify(self._deadlines)

    def _note_counter(self, tenant_id: str) -> None:
        """Record a backlogged tenant's (new) counter for the least-counter lookup."""
        heapq.heappush(self._waiting_counters, (self._counters.get(tenant_id, 0.0), tenant_id))
        if len(self._waiting_counters) > 4 * len(self._backlogs) + 64:
            self._waiting_counters = [(self._counters.get(t, 0.0), t) for t in self._backlogs]
            heapq.heapify(self._waiting_counters)

    def _least_waiting_counter(self) -> float | None:
        heap = self._waiting_counters
        while heap:
            counter, tenant_id = heap[0]
            if tenant_id in self._backlogs and self._counters.get(tenant_id, 0.0) == counter:
                return counter
            heapq.heappop(heap)
        return None

    def _lift_counter(self, tenant_id: str) -> None:
        """No banking of idle credit: an arriving tenant starts no lower than the
        least-served tenant that is currently waiting."""
        least = self._least_waiting_counter()
        target = self._floor if least is None else least
        self._counters[tenant_id] = max(self._counters.get(tenant_id, 0.0), target)

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
                for tier, entry in self._tier_heads(backlog, now)]
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
                for tier, head in self._tier_heads(backlog, now):
                    heapq.heappush(heap, self._ranked(request.tenant_id, tier, head, stamp))
            yield release

    def _ranked(self, tenant_id: str, tier: PriorityClass, entry: _Entry, stamp: int) -> tuple:
        """A head's place in release order: tier, VTC counter, running per weight, FIFO (seq is
        unique, so comparison never reaches the stamp or the entry)."""
        return (tier.rank, self._counters.get(tenant_id, 0.0), self._running.get(tenant_id, 0) / entry.request.weight,
                entry.seq, stamp, tier, entry)

    def _candidates(self, now: float) -> list[tuple[PriorityClass, _Entry]]:
        """Every tenant's eligible head per tier, best first."""
        running = self._running
        ranked: list[tuple[int, float, float, int, PriorityClass, _Entry]] = []
        for tenant_id, backlog in self._backlogs.items():
            counter = self._counters.get(tenant_id, 0.0)
            for tier, entry in self._tier_heads(backlog, now):
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
        for tier, entry in self._tier_heads(self._backlogs[tenant_id], now):
            if entry.request.request_id == request_id:
                return self._release(entry, tier, now)
        return None  # no longer a head (expired, or its tenant's FIFO moved): leave it to pop_next

    def requeue(self, request: QueuedRequest, seq: int) -> None:
        """Put a request back at its original place (``seq``) in its tenant's FIFO, e.g. a
        preempted one: it stays ahead of that tenant's newer work."""
        if request.request_id in self._where:
            return
        # No counter lift: the tenant was not idle, its request was running.
        backlog = self._backlogs.setdefault(request.tenant_id, _TenantBacklog())
        self._add_entry(backlog, _Entry(request, seq))
        fifo = backlog.by_class[request.priority]
        ordered = sorted(fifo.values(), key=lambda e: e.seq)
        fifo.clear()
        fifo.update((e.request.request_id, e) for e in ordered)

    def _tier_heads(self, backlog: _TenantBacklog, now: float) -> list[tuple[PriorityClass, _Entry]]:
        interactive = self._first_live(backlog.by_class[PriorityClass.INTERACTIVE], now)
        batch = self._first_live(backlog.by_class[PriorityClass.BATCH], now)
        heads: list[tuple[PriorityClass, _Entry]] = []
        if batch is not None and self.config.aging.is_aged(batch.request.enqueued_at, now):
            # The aged batch head joins the interactive tier; FIFO inside the tenant
            # decides between it and the tenant's own interactive head. The rest of
            # the batch FIFO waits behind it, so there is no batch-tier head.
            if interactive is None or batch.seq < interactive.seq:
                interactive = batch
            batch = None
        if interactive is not None:
            heads.append((PriorityClass.INTERACTIVE, interactive))
        if batch is not None:
            heads.append((PriorityClass.BATCH, batch))
        return heads

    def _first_live(self, fifo: dict[str, _Entry], now: float) -> _Entry | None:
        for entry in fifo.values():
            if not DeadlinePolicy.is_expired(entry.request.deadline, now):
                return entry
        return None

    def _release(self, entry: _Entry, tier: PriorityClass, now: float) -> Release:
        req = entry.request
        weighted = self.config.weighted_tokens(req.prompt_tokens, req.max_tokens)
        self._counters[req.tenant_id] = self._counters.get(req.tenant_id, 0.0) + weighted / req.weight
        # Charge before taking out: if this drains the queue, the floor must include it.
        self._take_out(req)
        if req.tenant_id in self._backlogs:
            self._note_counter(req.tenant_id)
        charge = Charge(req.request_id, req.tenant_id, weighted, req.weight, now)
        self._add_charge(charge)
        return Release(req, charge, tier, entry.seq)

    def _add_charge(self, charge: Charge) -> None:
        self._drop_charge(charge.request_id)  # a request released again replaces its charge
        self._unsettled[charge.request_id] = charge
        self._running[charge.tenant_id] = self._running.get(charge.tenant_id, 0) + 1

    def _drop_charge(self, request_id: str) -> Charge | None:
        charge = self._unsettled.pop(request_id, None)
        if charge is not None:
            left = self._running[charge.tenant_id] - 1
            if left:
                self._running[charge.tenant_id] = left
            else:
                del self._running[charge.tenant_id]
        return charge

    def _take_out(self, req: QueuedRequest) -> None:
        backlog = self._backlogs[req.tenant_id]
        backlog.discard(req)
        del self._where[req.request_id]
        if not len(backlog):
            del self._backlogs[req.tenant_id]
            if not self._backlogs:
                self._floor = max(self._floor, self._counters.get(req.tenant_id, 0.0))

    # ---------------------------------------------------------------- usage

    def on_usage(self, tenant_id: str, prompt_tokens: int, completion_tokens: int, estimated: Charge) -> float:
        """Replace the estimate charged at release by the actual usage.

        Returns the correction applied to the tenant's counter (negative when the
        completion was shorter than ``max_tokens``). A second call for the same
        charge, or one for a charge this queue never made, changes nothing and
        returns 0.0, so duplicated usage events are harmless. To refund a request
        that failed before doing any work, pass zero tokens.
        """
        if self._unsettled.get(estimated.request_id) != estimated or estimated.tenant_id != tenant_id:
            return 0.0
        self._drop_charge(estimated.request_id)
        actual = self.config.weighted_tokens(prompt_tokens, completion_tokens)
        delta = (actual - estimated.weighted_tokens) / estimated.weight
        self._counters[tenant_id] = self._counters.get(tenant_id, 0.0) + delta
        if tenant_id in self._backlogs:
            self._note_counter(tenant_id)
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
        self._forget_stale_charges(now)
        return [shed for _, shed in doomed]

    def _forget_stale_charges(self, now: float) -> None:
        # A charge only goes stale after unsettled_ttl_s, so looking a few times per TTL is enough,
        # and cheaper than walking every request in flight on each shedding pass.
        if self._charges_checked_at is not None and now - self._charges_checked_at < self.config.unsettled_ttl_s / 16:
            return
        self._charges_checked_at = now
        horizon = now - self.config.unsettled_ttl_s
        for request_id in [r for r, c in self._unsettled.items() if c.released_at < horizon]:
            self._drop_charge(request_id)

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
        return dict(self._running)

    def counter(self, tenant_id: str) -> float:
        """The tenant's virtual token counter (weighted service / weight)."""
        return self._counters.get(tenant_id, 0.0)

    def queued(self) -> list[QueuedRequest]:
        """All queued requests in enqueue order."""
        entries = [e for b in self._backlogs.values() for e in b.entries()]
        return [e.request for e in sorted(entries, key=lambda e: e.seq)]

    # ---------------------------------------------------------------- persistence

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible state. Restoring it with :meth:`from_dict` gives a queue
        that makes exactly the same decisions."""
        entries = sorted((e for b in self._backlogs.values() for e in b.entries()), key=lambda e: e.seq)
        return {
            "version": STATE_VERSION,
            "next_seq": self._next_seq,
            "floor": self._floor,
            "counters": dict(self._counters),
            "requests": [{**e.request.to_dict(), "seq": e.seq} for e in entries],
            "unsettled": [c.to_dict() for c in self._unsettled.values()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], config: FairQueueConfig | None = None) -> FairQueue:
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported fair queue state version {data.get('version')!r}")
        queue = cls(config)
        queue._next_seq = int(data["next_seq"])
        queue._floor = float(data["floor"])
        queue._counters = {t: float(c) for t, c in data["counters"].items()}
        for item in sorted(data["requests"], key=lambda r: r["seq"]):
            request = QueuedRequest.from_dict(item)
            entry = _Entry(request, int(item["seq"]))  # an older state's "bypassed" is ignored
            queue._add_entry(queue._backlogs.setdefault(request.tenant_id, _TenantBacklog()), entry)
        for c in data["unsettled"]:
            queue._add_charge(Charge.from_dict(c))
        return queue
