"""Following a compacted topic into a view, on a thread of its own: the one implementation behind every
materialized view of a topic (ingress's tenant directory, stored responses and quota view, streams' gate
state).

The follower reads every partition from the beginning, forever (partition_reader.py: a stalled fetch
reads on with a new client), and hands each record to the view's `apply`, which decides what a tombstone
means and decodes the record (parking what it cannot use with `dead_letters`); a record whose `apply`
raises is parked too, never allowed to stop the view. It knows how far it has read, so a caller can wait
until the view holds everything the topic held at some moment:

* `wait_caught_up`: what the topic held when the follower started (a process that must not serve
  before it knows its tenants);
* `settled` (async) and `read_at` (blocking): what the topic holds now, its ends asked through
  topic_reader. Reaching a partition's end is what counts, not seeing its last offset (compaction may
  have removed the last records below the end).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, TypeVar

from confluent_kafka import OFFSET_BEGINNING, KafkaException, Message

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from infra.kafka.partition_reader import PartitionReader

log = logging.getLogger(__name__)
T = TypeVar("T")


class CompactedFollower:
    def __init__(self, topic: str, client_id: str, apply: Callable[[Message], None], *,
                 dead_letters: kafka_clients.DeadLetters | None = None, partitions: list[int] | None = None,
                 max_messages: int = 500):
        """`partitions`: the ones to follow (default: every partition the topic has when the thread starts,
        and what it held then is what `wait_caught_up` waits for)."""
        self.topic, self.client_id, self._apply = topic, client_id, apply
        self.dead_letters = dead_letters or kafka_clients.DeadLetters(None)
        self._partitions, self._max_messages = partitions, max_messages
        self._applied = threading.Condition()
        self._positions: dict[int, int] = {}  # partition -> the next offset to read (negative: none read yet)
        self._start_ends: dict[int, int] | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._stop = threading.Event()
        self._following = threading.Event()
        self._following.set()
        self._probe = topic_reader.EndProbe(f"{client_id}-ends")
        self._thread: threading.Thread | None = None

    # --- the thread ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.topic}-follower", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        partitions = self._partitions
        if partitions is None:
            ends = kafka_clients.with_retries(lambda: topic_reader.end_offsets(self.topic, self.client_id),
                                              f"reading `{self.topic}` metadata")
            partitions = list(ends)
            with self._applied:
                self._start_ends = ends
                self._applied.notify_all()
        reader = PartitionReader(self.client_id, {(self.topic, p): OFFSET_BEGINNING for p in partitions})
        try:
            self._follow(reader, partitions)
        finally:
            reader.close()
            self.dead_letters.flush()

    def _follow(self, reader: PartitionReader, partitions: list[int]) -> None:
        fetching = True
        while not self._stop.is_set():
            # The reader is only touched from this thread (a librdkafka call from another thread while
            # this one sits in consume() can block until that returns).
            if fetching != self._following.is_set():
                fetching = self._following.is_set()
                (reader.resume if fetching else reader.pause)()
            if not fetching:
                self._following.wait(0.2)
                continue
            try:
                msgs = reader.read(0.1, max_messages=self._max_messages)
            except KafkaException:  # pragma: no cover - closed under us
                time.sleep(0.1)
                continue
            with self._applied:
                for msg in msgs:
                    self._apply_one(msg)
                for p in partitions:
                    self._positions[p] = reader.next_offset((self.topic, p))
                self._applied.notify_all()
                waiters, self._waiters = self._waiters, []
            for loop, event in waiters:
                if not loop.is_closed():  # a waiter that gave up may have left with its loop
                    try:
                        loop.call_soon_threadsafe(event.set)
                    except RuntimeError:  # closed meanwhile
                        pass

    def _apply_one(self, msg: Message) -> None:
        try:
            self._apply(msg)
        except Exception as exc:  # never let one record stop the view
            self.dead_letters.unprocessable(msg, exc)

    def pause(self) -> None:
        """Stop reading (the view's owner has what it holds); `resume` reads on from where it stopped."""
        self._following.clear()

    def resume(self) -> None:
        self._following.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._following.set()
        if self._thread:
            self._thread.join(timeout)
        self._probe.close()

    # --- how far it has read ---
    def _behind(self, ends: dict[int, int]) -> list[int]:
        return [p for p, end in ends.items() if end > 0 and self._positions.get(p, -1) < end]

    def wait_caught_up(self, timeout: float) -> bool:
        """Wait until the view holds what the topic held when the follower started; False after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._applied:
            while self._start_ends is None or self._behind(self._start_ends):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._applied.wait(min(left, 0.5))
        return True

    def ends_now(self, timeout: float = 5.0) -> dict[int, int]:
        """The ends of the partitions followed (once known, no metadata request: only their watermarks)."""
        partitions = self._partitions
        if partitions is None and self._start_ends is not None:
            partitions = list(self._start_ends)
        return self._probe.ends(self.topic, partitions, timeout)

    def read_at(self, ends: dict[int, int], timeout: float, read: Callable[[], T]) -> T:
        """`read()` of the view once it holds every record below `ends`, with no record applied meanwhile.
        Raises TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        with self._applied:
            while behind := self._behind(ends):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"`{self.topic}` read to {self._positions} of {ends} in {timeout:.0f} s "
                                       f"(partitions {behind} behind)")
                self._applied.wait(min(left, 0.5))
            return read()

    async def settled(self, timeout_s: float) -> bool:
        """Return once everything on the topic when called has been applied: True; False after `timeout_s`
        or when its end could not be read (the broker is away, and the view answers from what it has)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            ends = await asyncio.wait_for(asyncio.to_thread(self.ends_now, timeout_s), timeout_s)
        except Exception as exc:  # noqa: BLE001 - the view still answers, from what it has read
            log.warning("could not read the end of `%s`: %s", self.topic, exc)
            return False
        return await self.applied(ends, deadline - loop.time())

    async def applied(self, ends: dict[int, int], timeout_s: float) -> bool:
        """Return once every record below `ends` (as `ends_now` gives them) has been applied: True; False
        after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            event = asyncio.Event()
            remaining = deadline - loop.time()
            with self._applied:
                if not self._behind(ends):
                    return True
                if remaining <= 0:
                    return False
                self._waiters.append((loop, event))
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                with self._applied:
                    if (loop, event) in self._waiters:
                        self._waiters.remove((loop, event))
                return False
