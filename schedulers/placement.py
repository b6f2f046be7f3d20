"""Where a released request runs: which worker of its model's pool (pure policy; streams/placement.py feeds it).

Fairness decides *who* goes next; placement decides *where*. Two policies:

* ``prefix-aware`` (the default): a worker's score is ``PREFIX_WEIGHT * hit + free``, where ``hit`` is the
  fraction of the prompt's cacheable blocks that lead the prompt and are in that worker's prefix cache, and
  ``free`` the fraction of its slots free (net of requests already sent its way). A full prefix hit is worth
  more than an idle worker, so a tenant's requests stay where its system prompt is cached; the free-slot
  term spreads prompts that nobody holds, and between equally free workers the one whose cache holds fewer
  blocks takes a new prefix (so tenants spread over the pool even when requests come one at a time).
  A request that runs with a LoRA adapter adds ``ADAPTER_WEIGHT`` for a worker that holds the adapter
  (loaded, or on its way there): loading one costs the worker a read of its weights and may evict an
  adapter another tenant is about to use, so a holder wins over a freer worker that would have to load it,
  and an adapter a pool has loaded once stays on one worker instead of being loaded on each in turn.
* ``least-loaded``: cache-blind, the most free slots wins (the baseline the benchmark compares against).

Only workers with a free slot compete: a cached prefix is no reason to queue behind a full batch while
another worker idles. When none has one (the pool's credits were granted from adverts this request's
worker has not reflected yet), the worker with the most free slots is chosen as it stands.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum

PREFIX_WEIGHT = 2.0
ADAPTER_WEIGHT = 1.0


class PlacementPolicy(str, Enum):
    PREFIX_AWARE = "prefix-aware"
    LEAST_LOADED = "least-loaded"


class PlacementReason(str, Enum):
    PREFIX = "prefix"  # the chosen worker holds leading blocks of the prompt
    ADAPTER = "adapter"  # it holds the request's LoRA adapter (and none of the prompt's blocks)
    LOAD = "load"  # nobody holds any: chosen by free slots
    FULL = "full"  # no worker has a free slot: the least loaded anyway


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    free_slots: int  # net of requests placed on it that its adverts do not show yet
    total_slots: int
    holds: Callable[[bytes], bool]  # is this summary key in the worker's prefix cache?
    cached_blocks: int = 0  # how many blocks it holds (or is expected to): ties go to the one holding fewer
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it holds (or is expected to)


@dataclass(frozen=True)
class Placement:
    worker_id: str
    reason: PlacementReason
    hit_blocks: int  # leading prompt blocks cached on the chosen worker
    loads_adapter: bool = False  # the request has an adapter the chosen worker does not hold


def _leading_hits(candidates: list[Candidate], keys: Iterator[bytes]) -> dict[str, int]:
    """Per worker, how many of the prompt's first blocks it holds, hashing only as far as anyone holds them."""
    hits = {c.worker_id: 0 for c in candidates}
    still = list(candidates)
    for key in keys:
        still = [c for c in still if c.holds(key)]
        if not still:
            break
        for c in still:
            hits[c.worker_id] += 1
    return hits


def place(candidates: Iterable[Candidate], prompt_keys: Iterator[bytes], cacheable_blocks: int,
          policy: PlacementPolicy = PlacementPolicy.PREFIX_AWARE, adapter: str | None = None) -> Placement | None:
    """The worker for one request, or None with no candidate. `prompt_keys` yields the prompt's summary keys
    lazily (schedulers/prefix_hash.summary_keys); `cacheable_blocks` is how many it can yield at most;
    `adapter` is the engine id of the request's LoRA adapter (None: the base model)."""
    pool = list(candidates)
    if not pool:
        return None

    def placed(c: Candidate, reason: PlacementReason, hit_blocks: int = 0) -> Placement:
        return Placement(c.worker_id, reason, hit_blocks, adapter is not None and adapter not in c.adapters)

    with_room = [c for c in pool if c.free_slots > 0]
    if not with_room:
        best = max(pool, key=lambda c: (c.free_slots / max(1, c.total_slots), c.worker_id))
        return placed(best, PlacementReason.FULL)

    def free(c: Candidate) -> float:
        return c.free_slots / max(1, c.total_slots)

    if policy is PlacementPolicy.LEAST_LOADED:
        best = max(with_room, key=lambda c: (free(c), -c.cached_blocks, c.worker_id))
        return placed(best, PlacementReason.LOAD)

    def holds_adapter(c: Candidate) -> float:
        return ADAPTER_WEIGHT if adapter is not None and adapter in c.adapters else 0.0

    hits = _leading_hits(with_room, prompt_keys) if cacheable_blocks else {c.worker_id: 0 for c in with_room}
    best = max(with_room, key=lambda c: (PREFIX_WEIGHT * hits[c.worker_id] / max(1, cacheable_blocks)
                                         + holds_adapter(c) + free(c), -c.cached_blocks, -len(c.adapters),
                                         c.worker_id))
    reason = (PlacementReason.PREFIX if hits[best.worker_id] else
              PlacementReason.ADAPTER if holds_adapter(best) else PlacementReason.LOAD)
    return placed(best, reason, hits[best.worker_id])
