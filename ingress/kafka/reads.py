"""The blocking Kafka reads behind tenant-facing lookups (a stored response's settle, a background
response's reply events, a batch's results), kept off the threads every tenant's requests need.

Before, these ran on the event loop's default thread pool, the one that also tokenizes and compiles every
tenant's prompts (about cores + 4 threads): a tenant holding a few dozen replays or looping on GETs held
those threads and stalled everyone's chat completions. Here they get:

* their own small pool (`KafkaReads`, TOKENMILL_KAFKA_READ_THREADS, default 4): when it is busy, lookups
  wait for each other, never for a tokenizer thread, and never hold one;
* reused consumers (`ConsumerPool`): a background response's reply events are read through a consumer
  taken from the pool and given back, not two fresh librdkafka clients per lookup;
* one coalesced watermark probe (`Coalesced`): every lookup arriving while a probe of the topic's ends is
  under way shares the next one, so N concurrent lookups cost one probe, not N.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Generic, TypeVar

from confluent_kafka import Consumer

from infra.kafka import clients as kafka_clients
from infra import settings

log = logging.getLogger(__name__)
T = TypeVar("T")


def read_threads() -> int:
    return settings.KAFKA_READ_THREADS.get()


class KafkaReads:
    """The process's pool for blocking Kafka reads of lookups (`run`), and its reusable consumers."""

    def __init__(self, client_id: str, threads: int | None = None, idle_consumers: int = 8):
        self.threads = threads or read_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kafka-reads")
        self.consumers = ConsumerPool(client_id, idle_consumers)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the pool. Cancelling the caller does not stop the call: every call passed here
        is bounded by a timeout of its own, so the pool's threads always come back."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def after(self, running: asyncio.Future | None, fn: Callable[[], Any]) -> None:
        """`fn()` on the pool once `running` (a call of `run` a caller gave up on) is done, so whatever that
        call was using is not touched by two threads at once."""
        def submit(_=None) -> None:
            try:
                self._pool.submit(fn)
            except RuntimeError:  # the pool is shut down: the process is stopping
                pass

        if running is None or running.done():
            submit()
        else:
            running.add_done_callback(submit)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.consumers.close()


class ConsumerPool:
    """Group-less consumers, assigned by whoever takes one and unassigned when given back; at most `idle`
    of them are kept between uses (the others are closed). Safe to use from several threads; each
    consumer is used by one taker at a time."""

    def __init__(self, client_id: str, idle: int):
        self.client_id, self.idle = client_id, idle
        self._free: list[Consumer] = []
        self._lock = threading.Lock()
        self.made = 0

    def take(self) -> Consumer:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.made += 1
            n = self.made
        return Consumer(kafka_clients.consumer_config(
            None, f"{self.client_id}-{n}", **{"enable.partition.eof": True, "fetch.wait.max.ms": 20}))

    def give_back(self, consumer: Consumer) -> None:
        try:
            consumer.unassign()
        except Exception:  # noqa: BLE001 - a broken client is not kept
            log.warning("a replay consumer could not be unassigned; closing it", exc_info=True)
            _close(consumer)
            return
        with self._lock:
            if len(self._free) < self.idle:
                self._free.append(consumer)
                return
        _close(consumer)

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for consumer in free:
            _close(consumer)


def _close(consumer: Consumer) -> None:
    try:
        consumer.close()
    except Exception:  # noqa: BLE001
        pass


class Coalesced(Generic[T]):
    """An async probe shared by its concurrent callers (single-flight). A caller gets the result of a
    probe that started after it called: the one under way when it called may have asked before a record
    the caller is looking for was written, so it waits for the next, which every caller arriving
    meanwhile shares. At most one probe runs at a time."""

    def __init__(self, probe: Callable[[], Awaitable[T]]):
        self._probe = probe
        self._running: asyncio.Future[T] | None = None
        self._next: asyncio.Future[T] | None = None
        self.probes = 0  # how many were made (for tests and metrics)

    async def __call__(self, timeout_s: float) -> T:
        if self._running is None or self._running.done():
            self._running = future = _observed(asyncio.ensure_future(self._start()))
        else:
            if self._next is None:
                self._next = _observed(asyncio.ensure_future(self._after(self._running)))
            future = self._next
        # shielded: a caller that gives up leaves the probe to the others (and it is bounded itself)
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)

    async def _start(self) -> T:
        self.probes += 1
        return await self._probe()

    async def _after(self, previous: asyncio.Future[T]) -> T:
        await asyncio.wait([previous])
        self._running, self._next = self._next, None
        return await self._start()


def _observed(future: asyncio.Future[T]) -> asyncio.Future[T]:
    """A probe whose every caller gave up still has its failure retrieved (no 'never retrieved' noise)."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future
