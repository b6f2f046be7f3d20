"""`tokenmill bench gate`: how many requests per second one gate (streams) process admits and releases.

    tokenmill bench gate [--tenants 10,1000] [--rates 400,800,1200,1600] [--seconds 15]
        [--slo-p99-ms 1000] [--cpus 1] [--json PATH]

The gate alone, with nothing else of tokenmill running: a private KRaft broker, one streams process
(pinned to `--cpus` cores) per scenario, and this process as both sides of it:

* the **edge**: synthetic `InferenceRequested` records on `requests` at an open-loop rate (a request's
  delay counts from its scheduled arrival, so a gate falling behind shows as a growing delay), spread
  round-robin over `--tenants` tenants whose limits are far above the load;
* the **pool**: a consumer draining `work` that answers each released request with its
  `RequestCompleted` on `usage` at once and advertises free slots on `capacity` every 50 ms.

A rate is *held* when every request was released exactly once (none rejected, shed or lost), each
tenant's requests left in the order they came (checked per `work` partition), the delay from arrival
to release had p99 within `--slo-p99-ms`, and the release rate kept up with the offered one. The CPU
seconds the streams process used per request are read from the kernel; `1 / cpu_s_per_request` is
the rate one core could sustain with nothing else on it.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infra.paths import local_dir
from tokenmill.progress import above_bars, bar
from tokenmill.benchmarks.harness import report as bench_report
from tokenmill.benchmarks.harness.report import percentile

if TYPE_CHECKING:
    from tokenmill.stack.kafka_broker import LocalKafka
    from tokenmill.stack.processes import Service

MODEL = "gate-bench-model"
POOL_SLOTS = 512
ADVERT_INTERVAL_S = 0.05


@dataclass
class StepResult:
    tenants: int
    offered_rps: float
    sent: int = 0
    released: int = 0
    duplicates: int = 0
    rejected: int = 0
    out_of_order: int = 0
    delay_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    broker_cpu_s: float = 0.0
    load_cpu_s: float = 0.0

    def row(self, slo_p99_ms: float) -> dict:
        p99 = percentile(self.delay_ms, 99)
        released_rps = self.released / self.wall_s if self.wall_s else 0.0
        lost = self.sent - self.released - self.rejected
        held = (lost == 0 and self.rejected == 0 and self.duplicates == 0 and self.out_of_order == 0
                and p99 is not None and p99 <= slo_p99_ms and released_rps >= 0.95 * self.offered_rps)
        return {
            "tenants": self.tenants, "offered_rps": self.offered_rps, "sent": self.sent,
            "released": self.released, "released_rps": round(released_rps, 1), "rejected": self.rejected,
            "lost": lost, "duplicates": self.duplicates, "out_of_order": self.out_of_order,
            "delay_p50_ms": _round(percentile(self.delay_ms, 50)), "delay_p99_ms": _round(p99),
            "cpu_s_per_request": round(self.cpu_s / self.released, 6) if self.released else None,
            "one_core_rps": round(self.released / self.cpu_s) if self.cpu_s else None,
            # What else ran on this machine meanwhile, per request: the broker and this load generator.
            "broker_cpu_s_per_request": round(self.broker_cpu_s / self.released, 6) if self.released else None,
            "load_cpu_s_per_request": round(self.load_cpu_s / self.released, 6) if self.released else None,
            "held": held,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


class SyntheticPool:
    """Both sides of the gate: publishes requests, drains `work`, answers usage, advertises capacity."""

    def __init__(self, prefix: str):
        from confluent_kafka import Consumer, Producer

        from infra.kafka import clients as kafka_clients

        self.prefix = prefix
        # Batched like a busy edge: the load generator shares this machine with the gate and the broker.
        self.producer = Producer(kafka_clients.producer_config("gate-bench", **{"linger.ms": 5}))
        self.consumer = Consumer(kafka_clients.consumer_config(None, "gate-bench-pool"))
        self.replies = Consumer(kafka_clients.consumer_config(None, "gate-bench-replies"))
        self.incarnation = uuid.uuid4().hex[:8]
        self.consumed_total = 0
        self.lock = threading.Lock()
        self.released: dict[str, list] = {}  # request id -> [(partition, released_at_ms, seen)]
        self.rejected: set[str] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def topic(self, name: str) -> str:
        return self.prefix + name

    def start(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        from schemas import topics

        self.consumer.assign([TopicPartition(self.topic(topics.WORK.name), p, OFFSET_BEGINNING)
                              for p in range(topics.WORK.partitions)])
        self.replies.assign([TopicPartition(self.topic(topics.REPLIES.name), 0, OFFSET_BEGINNING)])
        for target in (self._drain, self._advertise, self._read_replies):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self.producer.flush(10)
        self.consumer.close()
        self.replies.close()

    def send_tenants(self, tenant_ids: list[str]) -> None:
        from infra.kafka import clients as kafka_clients
        from schemas import codec, topics

        for tenant_id in tenant_ids:
            record = codec.new_event("TenantSnapshot", tenant_id=tenant_id)
            record = codec.decode(*codec.encode("TenantSnapshot", record)).record
            record.update(requests_per_minute=10**8, tokens_per_minute=10**10, max_concurrent=10**6,
                          max_queued=10**6, monthly_token_budget=10**14)
            kafka_clients.produce_event(self.producer, self.topic(topics.TENANTS.name), tenant_id,
                                        "TenantSnapshot", record)
        self.producer.flush(30)

    def request_record(self, request_id: str, tenant_id: str, arrived_ms: int) -> dict:
        from schemas import codec, topics

        return codec.new_event(
            "InferenceRequested", request_id=request_id, tenant_id=tenant_id, model=MODEL,
            endpoint="completions", prompt_token_ids=list(range(16)),
            sampling={"max_tokens": 8},  # the rest takes the schema's defaults
            priority="interactive", arrived_at_ms=arrived_ms, deadline_ms=arrived_ms + 120_000,
            reply_topic=self.topic(topics.REPLIES.name), reply_partition=0, reserved_tokens=24)

    def publish(self, records: list[tuple[str, str]], rate: float) -> float:
        """Open loop: record i goes out at t0 + i/rate, whatever the gate does. Returns t0.

        The records are encoded before t0 (their arrival times are known in advance), so that the
        load generator, which shares the machine with the gate, spends little while it runs."""
        from schemas import codec, topics

        requests_topic = self.topic(topics.REQUESTS.name)
        t0 = time.time() + 0.5 + len(records) * 60e-6
        encoded: list[tuple[str, bytes, list[tuple[str, str | bytes | None]]]] = []
        for i, (request_id, tenant_id) in enumerate(records):
            value, event_headers = codec.encode("InferenceRequested",
                                                self.request_record(request_id, tenant_id,
                                                                    int((t0 + i / rate) * 1000)))
            encoded.append((tenant_id, value, list(event_headers)))
        for i, (tenant_id, value, headers) in enumerate(encoded):
            wait = t0 + i / rate - time.time()
            if wait > 0:
                time.sleep(wait)
            while True:
                try:
                    self.producer.produce(requests_topic, key=tenant_id, value=value, headers=headers)
                    break
                except BufferError:
                    self.producer.poll(0.05)
            self.producer.poll(0)
        self.producer.flush(30)
        return t0

    def _drain(self) -> None:
        from infra.kafka import clients as kafka_clients
        from schemas import codec, topics

        usage_topic = self.topic(topics.USAGE.name)
        while not self._stop.is_set():
            first = self.consumer.poll(0.05)
            batch = [] if first is None else [first] + self.consumer.consume(num_messages=999, timeout=0)
            now_ms = time.time() * 1000
            for msg in batch:
                if msg.error():
                    continue
                record = codec.decode(msg.value(), msg.headers()).record
                rid = record["request_id"]
                with self.lock:
                    self.consumed_total += 1
                    self.released.setdefault(rid, []).append(
                        (msg.partition(), msg.offset(), now_ms - record["arrived_at_ms"], record["released_at_ms"]))
                done = codec.new_event(
                    "RequestCompleted", request_id=rid, tenant_id=record["tenant_id"], model=MODEL,
                    status="finished", priority="interactive", prompt_tokens=16, completion_tokens=8,
                    reserved_tokens=24, arrived_at_ms=record["arrived_at_ms"], finished_at_ms=int(now_ms),
                    worker_id="gate-bench-pool")
                kafka_clients.produce_event(self.producer, usage_topic, record["tenant_id"], "RequestCompleted",
                                            done)
            self.producer.poll(0)

    def _advertise(self) -> None:
        from infra.kafka import clients as kafka_clients
        from schemas import codec, topics

        capacity_topic = self.topic(topics.CAPACITY.name)
        while not self._stop.wait(ADVERT_INTERVAL_S):
            with self.lock:
                consumed = self.consumed_total
            record = codec.new_event(
                "CapacityAdvertised", worker_id="gate-bench-pool", incarnation=self.incarnation, model=MODEL,
                free_slots=POOL_SLOTS, free_kv_blocks=10**6, total_slots=POOL_SLOTS, total_kv_blocks=10**6,
                block_size=16, running=0, waiting=0, consumed_total=consumed, stopping=False)
            kafka_clients.produce_event(self.producer, capacity_topic, "gate-bench-pool", "CapacityAdvertised",
                                        record)

    def _read_replies(self) -> None:
        from schemas import codec

        while not self._stop.is_set():
            msg = self.replies.poll(0.1)
            if msg is None or msg.error():
                continue
            event = codec.decode(msg.value(), msg.headers())
            if event.name == "RequestError":
                with self.lock:
                    self.rejected.add(event.record["request_id"])


def _process_cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def run_step(pool: SyntheticPool, streams_pid: int, broker_pid: int, tenants: list[str], rate: float,
             seconds: float, tag: str) -> StepResult:
    count = max(1, int(rate * seconds))
    records = [(f"{tag}-{i % len(tenants)}-{i}", tenants[i % len(tenants)]) for i in range(count)]
    ids = {rid for rid, _ in records}
    step = StepResult(tenants=len(tenants), offered_rps=rate, sent=count)
    cpu_before = _process_cpu_s(streams_pid)
    broker_before, load_before = _process_cpu_s(broker_pid), _process_cpu_s(os.getpid())
    started = pool.publish(records, rate)
    deadline = time.time() + max(30.0, seconds)
    while time.time() < deadline:
        with pool.lock:
            done = sum(1 for rid in ids if rid in pool.released or rid in pool.rejected)
        if done >= count:
            break
        time.sleep(0.05)
    step.cpu_s = _process_cpu_s(streams_pid) - cpu_before
    step.broker_cpu_s = _process_cpu_s(broker_pid) - broker_before
    step.load_cpu_s = _process_cpu_s(os.getpid()) - load_before
    with pool.lock:
        seen = {rid: list(pool.released[rid]) for rid in ids if rid in pool.released}
        step.rejected = sum(1 for rid in ids if rid in pool.rejected)
    judge(step, seen, started)
    return step


def judge(step: StepResult, seen: dict[str, list[tuple]], started: float) -> None:
    """Fill in what the pool saw: ``seen`` maps each released request id ("<tag>-<tenant>-<n>", n
    in arrival order) to its sightings on `work` (partition, offset, delay ms, released_at_ms)."""
    step.released = len(seen)
    step.duplicates = sum(len(v) - 1 for v in seen.values())
    if seen:
        last_release_ms = max(entries[0][3] for entries in seen.values())
        step.wall_s = max(1e-3, last_release_ms / 1000 - started)
    step.delay_ms = [entries[0][2] for entries in seen.values()]
    # Per tenant and work partition (offsets are the gate's release order there), the releases must
    # keep the order the requests came in.
    last: dict[tuple[str, int], int] = defaultdict(lambda: -1)
    by_release = sorted((entries[0][0], entries[0][1], rid) for rid, entries in seen.items())
    for partition, _, rid in by_release:
        _, tenant_index, n = rid.rsplit("-", 2)
        key = (tenant_index, partition)
        if int(n) < last[key]:
            step.out_of_order += 1
        last[key] = max(last[key], int(n))


def running_pids(streams: Service, broker: LocalKafka) -> tuple[int, int]:
    """The pids of the gate's process and of the broker, whose CPU time each step measures."""
    broker_pid = broker.running_pid()
    if streams.proc is None or broker_pid is None:
        raise RuntimeError("the gate's streams process or the broker is not running")
    return streams.proc.pid, broker_pid


def run(args) -> dict:
    from tokenmill.stack.kafka_broker import LocalKafka
    from tokenmill.stack.processes import Service, exit_cleanly_on_termination, free_port

    exit_cleanly_on_termination()
    work = Path(tempfile.mkdtemp(prefix="tokenmill-bench-gate-"))
    broker = LocalKafka(work / "kafka", port=free_port(), controller_port=free_port())
    rates = [float(r) for r in args.rates.split(",")]
    tenant_counts = [int(t) for t in args.tenants.split(",")]
    rows: list[dict] = []
    try:
        bootstrap = broker.start()
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
        for n_tenants in tenant_counts:
            prefix = f"gb{uuid.uuid4().hex[:6]}."
            env = {"KAFKA_BOOTSTRAP_SERVERS": bootstrap, "TOKENMILL_TOPIC_PREFIX": prefix,
                   "TOKENMILL_STREAMS_METRICS_PORT": str(free_port()), "TOKENMILL_STREAMS_SUPERVISED": "1",
                   "TOKENMILL_BILLING_URL": "http://127.0.0.1:9", "TOKENMILL_BUDGET_POLL_S": "3600"}
            streams = Service(f"streams-{n_tenants}", ["serve", "streams"], env, work).start()
            try:
                streams.wait_log("scheduler active", timeout=120)
                streams_pid, broker_pid = running_pids(streams, broker)
                cpus = sorted(os.sched_getaffinity(0))
                if args.cpus and args.cpus < len(cpus):
                    os.sched_setaffinity(streams_pid, set(cpus[-args.cpus:]))
                pool = SyntheticPool(prefix)
                tenants = [f"gate-bench-{i}" for i in range(n_tenants)]
                pool.send_tenants(tenants)
                pool.start()
                try:
                    # A short warm-up so the first step does not pay for connections and caches.
                    run_step(pool, streams_pid, broker_pid, tenants, min(rates), 2.0, f"w{n_tenants}")
                    progress = bar(total=len(rates), desc=f"{n_tenants} tenants", unit="rate")
                    for rate in rates:
                        step = run_step(pool, streams_pid, broker_pid, tenants, rate, args.seconds,
                                        f"r{int(rate)}t{n_tenants}")
                        row = step.row(args.slo_p99_ms)
                        rows.append(row)
                        with above_bars():
                            print(f"  {n_tenants} tenants, {rate:.0f} req/s offered: released "
                                  f"{row['released_rps']}/s, delay p99 {row['delay_p99_ms']} ms, "
                                  f"{row['cpu_s_per_request']} cpu-s/request, held={row['held']}")
                        progress.update(1)
                    progress.close()
                finally:
                    pool.stop()
            finally:
                streams.stop()
    finally:
        broker.stop()
    return {"benchmark": "gate", "machine": bench_report.machine(), "seconds": args.seconds,
            "cpus": args.cpus, "slo_p99_ms": args.slo_p99_ms, "rows": rows,
            "held_rps": {str(t): max([r["offered_rps"] for r in rows if r["tenants"] == t and r["held"]],
                                     default=None) for t in tenant_counts}}


def format_table(rows: list[dict]) -> str:
    return "\n".join(bench_report.table(rows, [
        ("tenants", 7, "tenants", "d"), ("offered/s", 9, "offered_rps", ".0f"),
        ("released/s", 10, "released_rps", ".0f"), ("lost", 5, "lost", "d"), ("dup", 4, "duplicates", "d"),
        ("reorder", 7, "out_of_order", "d"), ("delay p50 ms", 12, "delay_p50_ms", ".1f"),
        ("delay p99 ms", 12, "delay_p99_ms", ".1f"), ("cpu ms/req", 10, lambda r: None if r["cpu_s_per_request"]
                                                       is None else r["cpu_s_per_request"] * 1000, ".3f"),
        ("1-core req/s", 12, "one_core_rps", "d"),
        ("broker ms/req", 13, lambda r: None if r["broker_cpu_s_per_request"] is None
         else r["broker_cpu_s_per_request"] * 1000, ".3f"),
        ("load ms/req", 11, lambda r: None if r["load_cpu_s_per_request"] is None
         else r["load_cpu_s_per_request"] * 1000, ".3f"),
        ("held", 5, "held", ""),
    ]))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="tokenmill bench gate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tenants", default="10,1000", help="tenant counts, one scenario each")
    p.add_argument("--rates", default="400,800,1200,1600", help="offered request rates (req/s)")
    p.add_argument("--seconds", type=float, default=15.0, help="how long each rate is offered")
    p.add_argument("--slo-p99-ms", type=float, default=1000.0, help="arrival-to-release delay a held rate keeps")
    p.add_argument("--cpus", type=int, default=1, help="cores the streams process is pinned to (0: no pinning)")
    p.add_argument("--json", default=str(local_dir() / "bench" / "gate.json"))
    args = p.parse_args(argv)
    result = run(args)
    print(format_table(result["rows"]))
    print(f"machine: {result['machine']}")
    bench_report.write_json(args.json, result)
    return result
