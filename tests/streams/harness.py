"""Test harness for streams: a real streams process, fake workers, and probes.

Each test gets its own topic prefix (TOKENMILL_TOPIC_PREFIX), so its streams process,
its fake workers and its probes see only its own traffic even though the session's
broker (and the integration stack's own streams) is shared.
"""
from __future__ import annotations

import tempfile
import threading
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from infra.kafka import clients as kafka_clients
from schemas import codec, topics
from tests.integration.processes import Service

REPO = Path(__file__).resolve().parents[2]


def now_ms() -> int:
    return int(time.time() * 1000)


class StreamsProcess(Service):
    """A streams process; its log spans restarts, so wait_log can count lifecycle lines across them."""

    def __init__(self, env: dict[str, str], name: str = "streams"):
        super().__init__(name, ["serve", "streams"], env,
                         Path(tempfile.mkdtemp(prefix="tokenmill-streams-test-")))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_log(self, marker: str, timeout: float = 60, count: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log().count(marker) >= count:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} never logged {marker!r}:\n{self.log()[-4000:]}")

    def wait_any_log(self, markers: tuple[str, ...], timeout: float = 60) -> str:
        """Wait until one of the markers is logged; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            for marker in markers:
                if marker in text:
                    return marker
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} logged none of {markers}:\n{self.log()[-4000:]}")

    def wait_active(self, timeout: float = 60, count: int = 1) -> None:
        self.wait_log("scheduler active", timeout, count)


class Topics:
    def __init__(self, prefix: str):
        self.prefix = prefix

    def __getattr__(self, name: str) -> str:
        spec = getattr(topics, name.upper())
        return self.prefix + spec.name


class Publisher:
    def __init__(self, t: Topics):
        self.t = t
        self.producer = Producer(kafka_clients.producer_config("streams-test", **{"linger.ms": 0}))

    def send(self, topic: str, key, name: str, record: dict, flush: bool = True) -> None:
        kafka_clients.produce_event(self.producer, topic, key, name, record)
        if flush:
            self.producer.flush(10)

    def flush(self) -> None:
        self.producer.flush(10)

    def tenant(self, tenant_id: str, **fields) -> None:
        record = codec.new_event("TenantSnapshot", tenant_id=tenant_id)
        defaults = codec.decode(*codec.encode("TenantSnapshot", record)).record
        defaults.update(fields)
        self.send(self.t.tenants, tenant_id, "TenantSnapshot", defaults)

    def request(self, tenant_id: str, model: str, *, request_id: str | None = None, priority: str = "interactive",
                prompt_tokens: int = 8, max_tokens: int = 8, deadline_s: float = 60.0, reserved: int | None = None,
                flush: bool = True) -> dict:
        rid = request_id or uuid.uuid4().hex
        arrived = now_ms()
        record = codec.new_event(
            "InferenceRequested", request_id=rid, tenant_id=tenant_id, model=model, endpoint="completions",
            prompt_token_ids=list(range(prompt_tokens)), sampling={"max_tokens": max_tokens},
            priority=priority, arrived_at_ms=arrived, deadline_ms=arrived + int(deadline_s * 1000),
            reply_topic=self.t.replies, reply_partition=0,
            reserved_tokens=prompt_tokens + max_tokens if reserved is None else reserved)
        record["sampling"] = codec.decode(*codec.encode("InferenceRequested", record)).record["sampling"]
        self.send(self.t.requests, tenant_id, "InferenceRequested", record, flush=flush)
        return record

    def cancel(self, tenant_id: str, request_id: str) -> None:
        self.send(self.t.cancellations, request_id, "RequestCancelled",
                  codec.new_event("RequestCancelled", request_id=request_id, tenant_id=tenant_id))

    def advert(self, worker_id: str, model: str, free_slots: int, consumed_total: int, incarnation: str = "inc-1",
               stopping: bool = False, flush: bool = True) -> None:
        record = codec.new_event(
            "CapacityAdvertised", worker_id=worker_id, incarnation=incarnation, model=model, free_slots=free_slots,
            free_kv_blocks=1000, total_slots=max(free_slots, 1), total_kv_blocks=1000, block_size=16, running=0,
            waiting=0, consumed_total=consumed_total, stopping=stopping)
        self.send(self.t.capacity, worker_id, "CapacityAdvertised", record, flush=flush)

    def completed(self, work: dict, completion_tokens: int, status: str = "finished", flush: bool = True) -> None:
        record = codec.new_event(
            "RequestCompleted", request_id=work["request_id"], tenant_id=work["tenant_id"], model=work["model"],
            status=status, priority=work["priority"], prompt_tokens=len(work["prompt_token_ids"]),
            completion_tokens=completion_tokens, reserved_tokens=work["reserved_tokens"],
            arrived_at_ms=work["arrived_at_ms"], finished_at_ms=now_ms())
        self.send(self.t.usage, work["tenant_id"], "RequestCompleted", record, flush=flush)


@dataclass
class Seen:
    event: codec.Event
    at: float  # time.time() when the probe read it
    partition: int
    offset: int


class Probe:
    """Reads topics from the beginning in a background thread and keeps what it saw."""

    def __init__(self, *topic_names: str):
        self.events: dict[str, list[Seen]] = defaultdict(list)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = Consumer(kafka_clients.consumer_config(None, f"probe-{uuid.uuid4().hex[:6]}"))
        assignment = []
        for name in topic_names:
            meta = self._consumer.list_topics(name, timeout=10).topics[name]
            assignment += [TopicPartition(name, p, OFFSET_BEGINNING) for p in meta.partitions]
        self._consumer.assign(assignment)
        self._assignment = assignment
        self._positions: dict[tuple[str, int], int] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            first = self._consumer.poll(0.05)
            batch = [] if first is None else [first] + self._consumer.consume(num_messages=499, timeout=0)
            for msg in batch:
                if msg.error() or msg.value() is None:
                    continue
                at = time.time()
                try:
                    event = codec.decode(msg.value(), msg.headers())
                except codec.UndecodableEvent:
                    continue
                with self._lock:
                    self.events[msg.topic()].append(Seen(event, at, msg.partition(), msg.offset()))
            # After what was just read: the next offset per partition, past aborted records and
            # transaction markers too (which no record shows).
            positions = {(tp.topic, tp.partition): tp.offset for tp in self._consumer.position(self._assignment)}
            with self._lock:
                self._positions = positions

    @staticmethod
    def end_offsets(topic: str) -> dict[int, int]:
        from infra.kafka import topic_reader

        return topic_reader.end_offsets(topic)

    def read_up_to(self, topic: str, ends: dict[int, int]) -> bool:
        """Whether everything before ``ends`` (partition -> offset) on the topic has been read."""
        with self._lock:
            return all(end == 0 or self._positions.get((topic, p), -1) >= end for p, end in ends.items())

    def get(self, topic: str, name: str | None = None) -> list[Seen]:
        with self._lock:
            return [s for s in self.events[topic] if name is None or s.event.name == name]

    def wait(self, predicate, timeout: float = 30.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = predicate()
            if result:
                return result
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()


class FakeWorker:
    """A stand-in for gpu_consumers/worker.py with its capacity semantics, no engine.

    Consumes `work` in group `gpu-<model>`, keeps at most ``slots`` requests "running",
    finishes each after ``service_s`` with ``completion_tokens`` tokens (a RequestCompleted on
    `usage`), and advertises free_slots / consumed_total on `capacity` whenever they change
    and at least every ``advert_interval_s``. Records when each request was taken in.
    """

    def __init__(self, t: Topics, pub: Publisher, model: str, slots: int, service_s: float = 0.2,
                 completion_tokens: int = 4, worker_id: str | None = None, advert_interval_s: float = 1.0):
        self.t, self.pub, self.model, self.slots = t, pub, model, slots
        self.service_s, self.completion_tokens = service_s, completion_tokens
        self.worker_id = worker_id or f"fake-{uuid.uuid4().hex[:6]}"
        self.incarnation = uuid.uuid4().hex[:8]
        self.advert_interval_s = advert_interval_s
        self.producer = Producer(kafka_clients.producer_config(self.worker_id, **{"linger.ms": 0}))
        self.consumer = Consumer(kafka_clients.consumer_config(f"gpu-{model}-{t.prefix}", self.worker_id))
        self.assigned = threading.Event()
        self.consumer.subscribe([t.work], on_assign=lambda c, parts: self.assigned.set())
        self.running: dict[str, tuple[dict, float]] = {}
        self.pending: deque = deque()
        self.taken: list[tuple[float, dict]] = []  # (time, work record), in the order taken in
        self.consumed_total = 0
        self.max_running = 0
        self.paused = False
        self._stop = threading.Event()
        self._last_advert = 0.0
        self._last_free = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, wait: bool = True) -> "FakeWorker":
        self._thread.start()
        if wait and not self.assigned.wait(30):
            raise TimeoutError("fake worker got no work partitions")
        return self

    def _advertise(self, force: bool = False, stopping: bool = False) -> None:
        free = self.slots - len(self.running) - len(self.pending)
        if self.paused:
            free = 0
        if not force and free == self._last_free and time.monotonic() - self._last_advert < self.advert_interval_s:
            return
        self._last_free = free
        self._last_advert = time.monotonic()
        record = codec.new_event(
            "CapacityAdvertised", worker_id=self.worker_id, incarnation=self.incarnation, model=self.model,
            free_slots=max(0, free), free_kv_blocks=1000, total_slots=self.slots, total_kv_blocks=1000,
            block_size=16, running=len(self.running), waiting=len(self.pending), consumed_total=self.consumed_total,
            stopping=stopping)
        kafka_clients.produce_event(self.producer, self.t.capacity, self.worker_id, "CapacityAdvertised", record)
        self.producer.poll(0)

    def _run(self) -> None:
        # Like a real worker should: advertise only once `work` partitions are ours,
        # or streams would release into partitions nobody reads yet.
        while not self.assigned.is_set() and not self._stop.is_set():
            self.consumer.poll(0.05)
        self._advertise(force=True)
        while not self._stop.is_set():
            room = self.slots - len(self.running) - len(self.pending)
            if room > 0 and not self.paused:
                first = self.consumer.poll(0.01)
                batch = [] if first is None else [first]
                if first is not None and room > 1:
                    batch += self.consumer.consume(num_messages=room - 1, timeout=0)
                for msg in batch:
                    if msg.error():
                        continue
                    self.consumed_total += 1
                    record = codec.decode(msg.value(), msg.headers()).record
                    self.taken.append((time.time(), record))
                    self.pending.append(record)
            else:
                time.sleep(0.005)
            while self.pending:
                record = self.pending.popleft()
                self.running[record["request_id"]] = (record, time.time())
            self.max_running = max(self.max_running, len(self.running))
            now = time.time()
            for rid, (record, started) in list(self.running.items()):
                if now - started >= self.service_s:
                    del self.running[rid]
                    done = codec.new_event(
                        "RequestCompleted", request_id=rid, tenant_id=record["tenant_id"], model=record["model"],
                        status="finished", priority=record["priority"], prompt_tokens=len(record["prompt_token_ids"]),
                        completion_tokens=self.completion_tokens, reserved_tokens=record["reserved_tokens"],
                        arrived_at_ms=record["arrived_at_ms"], finished_at_ms=now_ms(), worker_id=self.worker_id)
                    kafka_clients.produce_event(self.producer, self.t.usage, record["tenant_id"], "RequestCompleted",
                                                done)
            self._advertise()
            self.producer.poll(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._advertise(force=True, stopping=True)
        self.producer.flush(5)
        self.consumer.close()


def streams_env(kafka_bootstrap: str, prefix: str, **extra: str) -> dict[str, str]:
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "TOKENMILL_TOPIC_PREFIX": prefix,
        "TOKENMILL_STREAMS_METRICS_PORT": "0",
        "TOKENMILL_STREAMS_SESSION_TIMEOUT_S": "6",
    }
    env.update(extra)
    return env
