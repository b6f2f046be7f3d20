"""The gate's side of prefix-aware placement: what each worker's prefix cache holds, and the worker (and
`work` partition) a released request is addressed to.

Workers put the partitions of `work` they are assigned and, now and then, a summary of their prefix cache
on their capacity adverts (gpu_consumers/prefix_summary.py). A request placed on a worker is produced to one
of that worker's partitions, so the worker's consumer, and nobody else's, reads it; if the worker dies, the
consumer group hands its partitions to the others and the request runs there, as any record of a dead
worker's partition does. A request is addressed by key, as before placement, when no live worker of its
model says which partitions it reads (a pool of older workers, or none yet assigned), or with one worker.

Summaries are soft state, not persisted: a new gate owner places by load until the first summaries reach it
(within gpu_consumers.prefix_summary.REFRESH_S). Between summaries, a request placed on a worker is taken to
put its prompt's blocks there (*expected* blocks, held ``EXPECTED_TTL_S``): the next request with the same
prefix follows it instead of landing on a worker where the prefix is not cached yet.

LoRA adapters are placed the same way: adverts list the adapters a worker's engine holds
(`resident_adapters`), a request with an adapter is taken to load it where it is placed (expected for
``EXPECTED_TTL_S``), and its prompt is hashed with the engine's adapter salt, so its prefix hits are the
engine's. A placement on a worker that holds neither is an adapter load (counted by the gate).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from schedulers.placement import Candidate, Placement, PlacementPolicy, PlacementReason, place
from formats.prefix_hash import adapter_cache_salt, cacheable_blocks, summary_keys, unpack_keys
from schemas.records import CapacityAdvertised, InferenceRequested
from streams.credits import PoolCredits

EXPECTED_TTL_S = 3.0


@dataclass(frozen=True)
class Addressed:
    worker_id: str | None  # None: not placed, addressed by key
    partition: int | None
    reason: str  # a PlacementReason value, or "by-key"
    hit_blocks: int = 0
    loads_adapter: bool = False


UNPLACED = Addressed(None, None, "by-key")


class PrefixIndex:
    """Per worker: the summary keys of its last summary, and the keys expected there since."""

    def __init__(self) -> None:
        self._summaries: dict[str, tuple[str, set[bytes]]] = {}  # worker id -> (incarnation, keys)
        self._expected: dict[str, dict[bytes, float]] = {}  # worker id -> key -> placed at

    def on_advert(self, advert: CapacityAdvertised, now: float) -> None:
        packed = advert.get("cached_blocks")
        worker, incarnation = advert["worker_id"], advert["incarnation"]
        if packed is not None:
            self._summaries[worker] = (incarnation, unpack_keys(packed))
            expected = self._expected.get(worker)
            if expected:  # what the summary shows need not be expected any more; the rest waits its TTL
                for key in [k for k in expected if k in self._summaries[worker][1]]:
                    del expected[key]
        elif worker in self._summaries and self._summaries[worker][0] != incarnation:
            del self._summaries[worker]  # a restarted worker's cache starts empty
            self._expected.pop(worker, None)

    def expect(self, worker_id: str, keys: list[bytes], now: float) -> None:
        expected = self._expected.setdefault(worker_id, {})
        for key in keys:
            expected[key] = now

    def expire(self, now: float) -> None:
        horizon = now - EXPECTED_TTL_S
        for expected in self._expected.values():
            for key in [k for k, at in expected.items() if at < horizon]:
                del expected[key]

    def holds(self, worker_id: str):
        summary = self._summaries.get(worker_id, ("", set()))[1]
        expected = self._expected.get(worker_id, {})
        return lambda key: key in summary or key in expected

    def size(self, worker_id: str) -> int:
        """Blocks in the worker's last summary."""
        return len(self._summaries.get(worker_id, ("", set()))[1])

    def held(self, worker_id: str) -> int:
        """Blocks the worker holds or is expected to (an estimate: the two sets may overlap)."""
        return self.size(worker_id) + len(self._expected.get(worker_id, ()))


def request_adapter(record: InferenceRequested) -> str | None:
    """The engine's id of a request's LoRA adapter (infra/adapters.engine_adapter_id), None for the base model."""
    ref = record.get("adapter")
    return f"{ref['adapter_id']}@{ref['version'][:12]}" if ref else None


class AdapterIndex:
    """Per worker: the adapters its last advert listed, and those expected there since."""

    def __init__(self) -> None:
        self._resident: dict[str, frozenset[str]] = {}
        self._expected: dict[str, dict[str, float]] = {}

    def on_advert(self, advert: CapacityAdvertised) -> None:
        resident = frozenset(advert.get("resident_adapters") or ())
        self._resident[advert["worker_id"]] = resident
        expected = self._expected.get(advert["worker_id"])
        for adapter in [a for a in (expected or ()) if a in resident]:
            del expected[adapter]  # type: ignore[union-attr]

    def expect(self, worker_id: str, adapter: str, now: float) -> None:
        self._expected.setdefault(worker_id, {})[adapter] = now

    def expire(self, now: float) -> None:
        horizon = now - EXPECTED_TTL_S
        for expected in self._expected.values():
            for adapter in [a for a, at in expected.items() if at < horizon]:
                del expected[adapter]

    def held(self, worker_id: str) -> frozenset[str]:
        return self._resident.get(worker_id, frozenset()) | frozenset(self._expected.get(worker_id, ()))


class Placer:
    def __init__(self, credits: PoolCredits, policy: PlacementPolicy) -> None:
        self.credits = credits
        self.policy = PlacementPolicy(policy)
        self.index = PrefixIndex()
        self.adapters = AdapterIndex()
        self._rotation: dict[str, itertools.count] = {}

    def on_advert(self, advert: CapacityAdvertised, now: float) -> None:
        self.index.on_advert(advert, now)
        self.adapters.on_advert(advert)

    def expire(self, now: float) -> None:
        self.index.expire(now)
        self.adapters.expire(now)

    def address(self, record: InferenceRequested, now: float) -> Addressed:
        """The worker and `work` partition for one request being released (not yet counted in transit)."""
        model = record["model"]
        workers = [w for w in self.credits.live_workers(now, model) if w.work_partitions]
        if len(workers) < 2:
            return UNPLACED  # nothing to choose between: by key, as without placement
        block_size = workers[0].block_size
        tokens = record["prompt_token_ids"]
        adapter = request_adapter(record)
        salt = record.get("cache_salt") if adapter is None else adapter_cache_salt(record.get("cache_salt"), adapter)
        hashing = summary_keys(tokens, block_size, salt)
        keys: list[bytes] = []

        def lazily():
            for key in hashing:
                keys.append(key)
                yield key

        candidates = [Candidate(w.worker_id, w.free_slots - self.credits.in_transit(model, w.worker_id),
                                w.total_slots, self.index.holds(w.worker_id), self.index.held(w.worker_id),
                                self.adapters.held(w.worker_id))
                      for w in workers]
        chosen: Placement | None = place(candidates, lazily(), cacheable_blocks(len(tokens), block_size),
                                         self.policy, adapter)
        if chosen is None:
            return UNPLACED
        if self.policy is PlacementPolicy.PREFIX_AWARE:
            # Its blocks will be cached there: hash the rest of the prompt (placement stopped at the first
            # block nobody holds) so the next request with this prefix follows.
            keys.extend(hashing)
            self.index.expect(chosen.worker_id, keys, now)
            if adapter is not None:
                self.adapters.expect(chosen.worker_id, adapter, now)
        view = next(w for w in workers if w.worker_id == chosen.worker_id)
        turn = next(self._rotation.setdefault(view.worker_id, itertools.count()))
        partition = view.work_partitions[turn % len(view.work_partitions)]
        return Addressed(view.worker_id, partition, chosen.reason.value, chosen.hit_blocks, chosen.loads_adapter)
