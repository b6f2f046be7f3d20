"""`tokenmill bench lora-placement`: adapter-aware against load-only placement, on a simulated pool.

    tokenmill bench lora-placement [--workers 2] [--adapters 16] [--max-loras 4] [--slots 8]
        [--requests 4000] [--loads 0.3,0.5,0.7] [--popularity uniform,zipf] [--seed 7] [--json PATH]

The placement decision is the gate's own code (schedulers/placement.place, and streams/placement's
AdapterIndex for what each worker holds or is expected to); the workers around it are simulated, because
two real workers of the real model on this 2-core machine would measure the CPU, not the policy. Each
simulated worker has ``--slots`` sequence slots and ``--max-loras`` adapter slots, least recently used
evicted, an adapter in use by a running sequence never (a request whose adapter cannot be loaded for that
waits on its worker). Workers advertise their free slots and resident adapters every ``ADVERT_S``, so the
gate places on a view that lags, as it does live; the gate holds a request until a worker has a free slot.
Requests arrive as one Poisson stream at each of ``--loads`` (fractions of the pool's slot capacity), each for one of ``--adapters`` adapters (``uniform``: each equally likely; ``zipf``:
the k-th most popular with weight 1/k, the usual shape of tenants' traffic), and decode for an exponential
time (mean ``SERVICE_MEAN_S``). The same workload (arrivals, adapters, service times) runs under each
policy. Reported: adapter loads (a request started on a worker whose engine did not hold its adapter),
the ratio adapter-aware / load-only (target <= 0.5), and the wait from arrival to start (p50/p99), which
shows the policy does not buy fewer loads with queueing.
"""
from __future__ import annotations

import argparse
import heapq
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TypedDict

from infra.paths import local_dir
from schedulers.placement import Candidate, PlacementPolicy, place
from schemas.records import CapacityAdvertised
from streams.placement import AdapterIndex
from tokenmill.benchmarks.harness.report import machine, percentile, table, write_json

ADVERT_S = 0.5
SERVICE_MEAN_S = 2.0
POLICIES = {"load-only": PlacementPolicy.LEAST_LOADED, "adapter-aware": PlacementPolicy.PREFIX_AWARE}


@dataclass
class Request:
    arrival: float
    adapter: str
    service_s: float
    start: float | None = None


@dataclass
class SimWorker:
    worker_id: str
    slots: int
    max_loras: int
    running: int = 0
    resident: OrderedDict[str, int] = field(default_factory=OrderedDict)  # adapter -> sequences using it, LRU first
    waiting: deque[Request] = field(default_factory=deque)
    loads: int = 0

    def try_start(self, req: Request) -> bool:
        if self.running >= self.slots:
            return False
        if req.adapter not in self.resident:
            if len(self.resident) >= self.max_loras:
                idle = next((a for a, users in self.resident.items() if users == 0), None)
                if idle is None:
                    return False  # every adapter slot is in use by a running sequence
                del self.resident[idle]
            self.resident[req.adapter] = 0
            self.loads += 1
        self.resident[req.adapter] += 1
        self.resident.move_to_end(req.adapter)
        self.running += 1
        return True

    def finish(self, req: Request) -> None:
        self.running -= 1
        self.resident[req.adapter] -= 1

    def advert(self, now: float) -> CapacityAdvertised:
        """What this worker tells the gate; the placement reads only its id and resident adapters."""
        return {"event_id": f"{self.worker_id}-{now}", "request_id": None, "schema_version": 1,
                "timestamp_ms": int(now * 1000), "worker_id": self.worker_id, "incarnation": "simulated",
                "model": "simulated", "free_slots": self.slots - self.running, "free_kv_blocks": 0,
                "total_slots": self.slots, "total_kv_blocks": 0, "block_size": 0, "running": self.running,
                "waiting": len(self.waiting), "consumed_total": 0, "stopping": False, "work_partitions": [],
                "cached_blocks": None, "resident_adapters": list(self.resident)}


class PoolResult(TypedDict):
    """One policy's run over one workload."""
    adapter_loads: int
    requests: int
    wait_p50_s: float | None
    wait_p99_s: float | None
    loads_by_worker: dict[str, int]


# what an event carries: an arriving request, a (worker, request) that finishes, or None for an advert round
EventPayload = Request | tuple[SimWorker, Request] | None


def workload(requests: int, adapters: int, popularity: str, rate: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    names = [f"tenant-{i}/adapter-{i}@v1" for i in range(adapters)]
    weights = [1.0] * adapters if popularity == "uniform" else [1.0 / (k + 1) for k in range(adapters)]
    t, out = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate)
        out.append(Request(t, rng.choices(names, weights)[0], rng.expovariate(1 / SERVICE_MEAN_S)))
    return out


class PoolSimulation:
    """The gate placing requests on a pool of simulated workers, in event time: arrivals, adverts of
    free slots and resident adapters every ADVERT_S, and finishes."""

    def __init__(self, policy: PlacementPolicy, n_workers: int, slots: int, max_loras: int) -> None:
        self.policy, self.slots = policy, slots
        self.workers = [SimWorker(f"w{i}", slots, max_loras) for i in range(n_workers)]
        self.index = AdapterIndex()
        self.advertised = {w.worker_id: slots for w in self.workers}  # free slots as of the last advert
        self.in_transit = {w.worker_id: 0 for w in self.workers}  # placed since that advert
        self.events: list[tuple[float, int, str, EventPayload]] = []
        self.seq = 0
        self.done: list[Request] = []
        self.queued: deque[Request] = deque()  # the gate's queue: released while a worker has a free slot

    def push(self, at: float, kind: str, what: EventPayload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, what))

    def release(self, now: float) -> None:
        while self.queued:
            candidates = [Candidate(w.worker_id, self.advertised[w.worker_id] - self.in_transit[w.worker_id],
                                    w.slots, lambda key: False, 0, self.index.held(w.worker_id))
                          for w in self.workers]
            if all(c.free_slots <= 0 for c in candidates):
                return  # no credit: the queue waits for the next advert
            req = self.queued.popleft()
            chosen = place(candidates, iter(()), 0, self.policy, req.adapter)
            assert chosen is not None
            if self.policy is PlacementPolicy.PREFIX_AWARE:
                self.index.expect(chosen.worker_id, req.adapter, now)
            self.in_transit[chosen.worker_id] += 1
            worker = next(w for w in self.workers if w.worker_id == chosen.worker_id)
            worker.waiting.append(req)
            self.drain(worker, now)

    def drain(self, worker: SimWorker, now: float) -> None:
        # the engine runs whatever waiting sequence it can (its adapter resident or loadable), in order
        for req in list(worker.waiting):
            if worker.try_start(req):
                worker.waiting.remove(req)
                req.start = now
                self.push(now + req.service_s, "finish", (worker, req))

    def advertise(self, now: float, total: int) -> None:
        for w in self.workers:
            self.index.on_advert(w.advert(now))
            self.advertised[w.worker_id], self.in_transit[w.worker_id] = w.slots - w.running - len(w.waiting), 0
        self.index.expire(now)
        if len(self.done) < total:
            self.push(now + ADVERT_S, "advert", None)

    def run(self, reqs: list[Request]) -> PoolResult:
        for req in [Request(r.arrival, r.adapter, r.service_s) for r in reqs]:
            self.push(req.arrival, "arrive", req)
        self.push(0.0, "advert", None)
        while self.events:
            now, _, kind, what = heapq.heappop(self.events)
            if kind == "advert":
                self.advertise(now, len(reqs))
            elif kind == "arrive":
                assert isinstance(what, Request)
                self.queued.append(what)
            elif kind == "finish":
                assert isinstance(what, tuple)
                worker, req = what
                worker.finish(req)
                self.done.append(req)
                self.drain(worker, now)
            self.release(now)
        waits = [r.start - r.arrival for r in self.done if r.start is not None]
        return {"adapter_loads": sum(w.loads for w in self.workers), "requests": len(self.done),
                "wait_p50_s": percentile(waits, 50), "wait_p99_s": percentile(waits, 99),
                "loads_by_worker": {w.worker_id: w.loads for w in self.workers}}


def simulate(reqs: list[Request], policy: PlacementPolicy, n_workers: int, slots: int,
             max_loras: int) -> PoolResult:
    return PoolSimulation(policy, n_workers, slots, max_loras).run(reqs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenmill bench lora-placement", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--loads", default="0.3,0.5,0.7", help="arrival rates as fractions of the pool's slot capacity")
    ap.add_argument("--popularity", default="uniform,zipf")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", default=str(local_dir() / "bench" / "lora_placement.json"))
    args = ap.parse_args(argv)
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        rate = load * args.workers * args.slots / SERVICE_MEAN_S
        for popularity in args.popularity.split(","):
            reqs = workload(args.requests, args.adapters, popularity, rate, args.seed)
            results = {name: simulate(reqs, policy, args.workers, args.slots, args.max_loras)
                       for name, policy in POLICIES.items()}
            ratio = results["adapter-aware"]["adapter_loads"] / max(1, results["load-only"]["adapter_loads"])
            for name, r in results.items():
                rows.append({"load": load, "rate_per_s": rate, "popularity": popularity, "policy": name, **r,
                             "ratio": ratio if name == "adapter-aware" else None})
    print(f"{args.workers} workers x {args.slots} slots, {args.adapters} adapters, {args.max_loras} adapter slots "
          f"per worker, {args.requests} Poisson arrivals per row (simulated pool, the gate's placement code)")
    for line in table(rows, [("load", 5, "load", ".0%"), ("req/s", 6, "rate_per_s", ".1f"),
                             ("popularity", -10, "popularity", ""), ("policy", -13, "policy", ""),
                             ("adapter loads", 13, "adapter_loads", "d"), ("wait p50 s", 10, "wait_p50_s", ".2f"),
                             ("wait p99 s", 10, "wait_p99_s", ".2f"), ("aware/load-only", 15, "ratio", ".2f"),
                             ("target", 7, lambda r: "<= 0.5" if r["ratio"] is not None else None, "")]):
        print(line)
    write_json(args.json, {"benchmark": "lora-placement", "machine": machine(), "simulated_pool": True,
                           "workers": args.workers, "slots": args.slots, "adapters": args.adapters,
                           "max_loras": args.max_loras, "requests": args.requests,
                           "advert_s": ADVERT_S, "service_mean_s": SERVICE_MEAN_S, "seed": args.seed, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
