"""Release credits: how many more requests the GPU pool can start right now.

Workers publish `CapacityAdvertised` on `capacity` (keyed by worker id) whenever their
free capacity changes and at least once a second. Each advert says, for one
*incarnation* (one run of the worker process):

* ``free_slots``: sequences it could start now, already net of the work it has taken
  in but not started (its own short waiting line);
* ``consumed_total``: how many `work` records *of its model* this incarnation has taken in so
  far (every pool reads all of `work` and skips other models' records; those do not count).

The pool's credit for a model is::

    credits(model) = sum(free_slots of live adverts of model) - in_transit(model)

**Live**: an advert whose own timestamp is at most ``advert_ttl_s`` old (the worker
advertises at least every second, so a silent worker is dead or stuck) and that is not
``stopping``. Only the newest advert per (worker id, incarnation) counts; a new
incarnation of the same worker id replaces the old one.

**In transit**: requests streams released to `work` that no advert accounts for yet.
An advert's ``free_slots`` only reflects the records the worker had taken in when it
wrote the advert, so every release is put on the model's in-transit list, and removed
when adverts show the pool took it in: when an advert raises a worker's
``consumed_total`` by *d* over its previous advert (a new incarnation counts from 0),
the *d* oldest in-transit entries of that model are removed (of that worker first, see below). Thus an advert written
before the worker saw our release (an old ``consumed_total``) cannot give the same slot
out twice, and one written after it (the record counted in ``consumed_total`` and
already subtracted from ``free_slots``) lets the in-transit entry go.

With placement (streams/placement.py) a release is addressed to one worker, and its in-transit entry is
kept under that worker: the worker's own advert settles it (then unaddressed entries), and the placement
subtracts it from that worker's free slots. Entries another worker took in (the partition moved) are
left to the TTL: that worker looks busier for a while, never freer than it is.

Two ways this can be wrong, both bounded and self-healing:

* a taken-in record that streams did not release in this epoch (a redelivery after a
  worker crash, another model's record skipped by a worker) also removes an in-transit
  entry: the pool is briefly over-credited by that many requests, which then wait in
  the worker's own line; the next adverts show the true free slots;
* a release that lands on a `work` partition owned by a busy worker is not taken in
  until that worker frees a slot. After ``in_transit_ttl_s`` the entry stops holding
  a credit, so one busy worker cannot block the idle rest of the pool for long.

With no live advert at all (no workers), credits are 0 and requests wait in the queue
until their deadline sheds them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from schemas.records import CapacityAdvertised

# Dead incarnations are remembered this long, so a late advert cannot resurrect credit
# and a pause longer than the advert TTL does not reset the consumed_total baseline.
FORGET_AFTER_S = 600.0


@dataclass
class WorkerView:
    worker_id: str
    incarnation: str
    model: str
    free_slots: int
    free_kv_blocks: int
    consumed_total: int
    advert_ms: int
    stopping: bool
    total_slots: int = 0
    block_size: int = 16
    work_partitions: tuple[int, ...] = ()  # where a request placed on this worker is addressed


class PoolCredits:
    def __init__(self, advert_ttl_s: float = 5.0, in_transit_ttl_s: float = 3.0) -> None:
        self.advert_ttl_s = advert_ttl_s
        self.in_transit_ttl_s = in_transit_ttl_s
        self._workers: dict[tuple[str, str], WorkerView] = {}
        self._current: dict[str, str] = {}  # worker id -> newest incarnation seen
        # model -> the worker a release was addressed to ("" = none, any worker may take it) ->
        # (request id, released at), oldest first
        self._in_transit: dict[str, dict[str, deque[tuple[str, float]]]] = {}

    # ------------------------------------------------------------ events

    def on_advert(self, advert: CapacityAdvertised) -> bool:
        """Apply one CapacityAdvertised record. Returns True if anything changed."""
        key = (advert["worker_id"], advert["incarnation"])
        prev = self._workers.get(key)
        if prev is not None and (advert["timestamp_ms"] < prev.advert_ms
                                 or advert["consumed_total"] < prev.consumed_total):
            return False  # an older advert, overtaken by a newer one
        taken = advert["consumed_total"] - (prev.consumed_total if prev else 0)
        view = WorkerView(advert["worker_id"], advert["incarnation"], advert["model"], int(advert["free_slots"]),
                          int(advert["free_kv_blocks"]), int(advert["consumed_total"]), int(advert["timestamp_ms"]),
                          bool(advert["stopping"]), int(advert.get("total_slots") or 0),
                          int(advert.get("block_size") or 16),
                          tuple(advert.get("work_partitions") or ()))
        self._workers[key] = view
        newest = self._current.get(view.worker_id)
        if newest is None or newest == view.incarnation or self._workers[(view.worker_id, newest)].advert_ms <= view.advert_ms:
            if newest is not None and newest != view.incarnation:
                old = self._workers.get((view.worker_id, newest))
                if old is not None:
                    old.stopping = True  # replaced by a newer run of the same worker
            self._current[view.worker_id] = view.incarnation
        else:
            view.stopping = True  # an advert of an incarnation already replaced
        # What this worker took in settles first the releases addressed to it, then unaddressed ones. A
        # record addressed to another worker that this one took (its partition moved) leaves that worker's
        # entry to its TTL: the other worker looks busier for a few seconds, never freer than it is.
        by_worker = self._in_transit.get(view.model, {})
        for target in (view.worker_id, ""):
            transit = by_worker.get(target)
            while taken > 0 and transit:
                transit.popleft()
                taken -= 1
        return True

    def on_release(self, model: str, request_id: str, now: float, worker_id: str | None = None) -> None:
        self._in_transit.setdefault(model, {}).setdefault(worker_id or "", deque()).append((request_id, now))

    def expire(self, now: float) -> bool:
        """Drop in-transit entries past their TTL and long-dead workers."""
        changed = False
        horizon = now - self.in_transit_ttl_s
        for by_worker in self._in_transit.values():
            for transit in by_worker.values():
                while transit and transit[0][1] < horizon:
                    transit.popleft()
                    changed = True
        forget_ms = (now - FORGET_AFTER_S) * 1000
        for key in [k for k, w in self._workers.items() if w.advert_ms < forget_ms]:
            view = self._workers.pop(key)
            if self._current.get(view.worker_id) == view.incarnation:
                del self._current[view.worker_id]
            changed = True
        return changed

    # ------------------------------------------------------------ views

    def _live(self, view: WorkerView, now: float) -> bool:
        return not view.stopping and now * 1000 - view.advert_ms <= self.advert_ttl_s * 1000

    def live_workers(self, now: float, model: str | None = None) -> list[WorkerView]:
        return [w for w in self._workers.values() if self._live(w, now) and (model is None or w.model == model)]

    def free_slots(self, model: str, now: float) -> int:
        return sum(max(0, w.free_slots) for w in self.live_workers(now, model))

    def in_transit(self, model: str, worker_id: str | None = None) -> int:
        """Releases no advert accounts for yet: of the model, or those addressed to one worker."""
        by_worker = self._in_transit.get(model)
        if not by_worker:
            return 0
        if worker_id is not None:
            transit = by_worker.get(worker_id)
            return len(transit) if transit else 0
        return sum(len(t) for t in by_worker.values())

    def available(self, now: float) -> dict[str, int]:
        """Credits per model with at least one live worker (missing model = 0)."""
        models = {w.model for w in self.live_workers(now)}
        return {m: max(0, self.free_slots(m, now) - self.in_transit(m)) for m in models}

    def models(self) -> set[str]:
        return {w.model for w in self._workers.values()} | set(self._in_transit)

    # ------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": [asdict(w) for w in self._workers.values()],
            "current": dict(self._current),
            "in_transit": {m: [[*e, w] for w, t in by_worker.items() for e in t]
                           for m, by_worker in self._in_transit.items() if any(by_worker.values())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, advert_ttl_s: float = 5.0,
                  in_transit_ttl_s: float = 3.0) -> PoolCredits:
        credits = cls(advert_ttl_s, in_transit_ttl_s)
        if not data:
            return credits
        for w in data.get("workers", []):
            view = WorkerView(**w)
            view.work_partitions = tuple(view.work_partitions)
            credits._workers[(view.worker_id, view.incarnation)] = view
        credits._current = dict(data.get("current", {}))
        for model, entries in data.get("in_transit", {}).items():
            for entry in sorted(entries, key=lambda e: float(e[1])):
                # [request id, released at] before releases were addressed; [.., worker] since
                target = entry[2] if len(entry) > 2 else ""
                credits._in_transit.setdefault(model, {}).setdefault(target, deque()).append(
                    (entry[0], float(entry[1])))
        return credits
