"""Reads this ingress process's own partition of `replies` and hands each event to
the request waiting for it.

The partition is assigned directly (no consumer group): the partition number is the
reply address every request from this process names.
"""
from __future__ import annotations

import asyncio
import logging
import threading

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from infra.kafka.partition_reader import PartitionReader
from ingress.kafka.reply_events import ReplyEvent
from schemas import codec, topics
from schemas.records import ReplyBatch, RequestError

log = logging.getLogger(__name__)


class ReplyRouter:
    def __init__(self, partition: int, loop: asyncio.AbstractEventLoop):
        self.partition = partition
        self.topic = topics.REPLIES.name
        self._loop = loop
        self._waiting: dict[str, asyncio.Queue[ReplyEvent]] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reply-router", daemon=True)
        self.undecodable = 0
        self.dead_letters = kafka_clients.DeadLetters(f"ingress-replies-{partition}")

    def register(self, request_id: str) -> asyncio.Queue[ReplyEvent]:
        queue: asyncio.Queue[ReplyEvent] = asyncio.Queue()
        self._waiting[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def start(self, timeout: float = 15.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("reply partition was not assigned in time")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _deliver(self, request_id: str | None, event: ReplyEvent) -> None:
        queue = self._waiting.get(request_id) if request_id is not None else None
        if queue is not None:
            queue.put_nowait(event)

    def _run(self) -> None:
        # Only traffic produced from now on can be ours: requests of an earlier process are gone with it.
        probe = topic_reader.EndProbe(f"ingress-replies-{self.partition}-end")
        try:
            high = kafka_clients.with_retries(lambda: probe.ends(self.topic, [self.partition], timeout=10),
                                              "reading the end of the reply partition")[self.partition]
        finally:
            probe.close()
        # A stalled fetch would leave every stream on this partition without its tail: the reader
        # reads on with a new client (infra/kafka/partition_reader.py).
        # The shared consumer settings' fetch wait: a fetch is answered on append (infra/kafka/clients.py).
        consumer = PartitionReader(f"ingress-replies-{self.partition}", {(self.topic, self.partition): high})
        self._ready.set()
        try:
            while not self._stop.is_set():
                for msg in consumer.read(0.05):
                    event = self.dead_letters.decode(msg, ("ReplyBatch", "RequestError"))
                    if event is None:
                        self.undecodable += 1
                        continue
                    if event.name == "ReplyBatch":
                        for item in codec.record_of(event, ReplyBatch)["items"]:
                            self._loop.call_soon_threadsafe(self._deliver, item["request_id"], ("item", item))
                    else:
                        error = codec.record_of(event, RequestError)
                        self._loop.call_soon_threadsafe(self._deliver, error["request_id"], ("error", error))
        finally:
            consumer.close()
            self.dead_letters.flush()
