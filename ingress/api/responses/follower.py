"""Every ingress process's follower of the compacted `responses` topic: it keeps a `ResponseStore`
(store.py) current, and reads back the records the store evicted from memory."""
from __future__ import annotations

import asyncio
import logging
import time

from confluent_kafka import TopicPartition

from infra.kafka import clients as kafka_clients
from infra.kafka.compacted_view import CompactedFollower
from ingress.api.responses.store import Evicted, ResponseStore
from ingress.kafka.reads import Coalesced, KafkaReads
from schemas import checks, codec, topics
from schemas.records import StoredResponse

log = logging.getLogger(__name__)


class ResponseFollower:
    """Keeps a ResponseStore current by reading `responses` from the beginning, forever (a thread).

    A lookup first waits until the follower has read what the topic held when the lookup began
    (`settled`): a response another ingress stored (and was acknowledged for) a moment ago is then
    found, and an unknown id is answered as soon as the follower is level, not after a fixed wait.

    The topic's ends are asked on the process's Kafka read pool, never the default one, and through one
    coalesced probe: concurrent lookups share a probe that began after they arrived (ingress/kafka/reads.py),
    so a tenant looping on GETs costs one probe at a time, whatever its rate."""

    PROBE_TIMEOUT_S = 2.0  # each watermark request of a probe

    def __init__(self, client_id: str, store: ResponseStore | None = None):
        self.store = store if store is not None else ResponseStore()  # an empty store is falsy (len 0)
        self.dead_letters = kafka_clients.DeadLetters(client_id)
        self._follower = CompactedFollower(topics.RESPONSES.name, client_id, self._handle,
                                           dead_letters=self.dead_letters)
        self._reads: KafkaReads | None = None
        self.ends = Coalesced(self._probe)

    async def _probe(self) -> dict[int, int]:
        assert self._reads is not None
        return await self._reads.run(self._follower.ends_now, self.PROBE_TIMEOUT_S)

    async def settled(self, timeout_s: float, reads: KafkaReads) -> None:
        """Return once everything on `responses` when called has been applied (or after `timeout_s`: the
        broker is away, and the view answers from what it has)."""
        self._reads = reads
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            ends = await self.ends(timeout_s)
        except Exception as exc:  # noqa: BLE001 - the view still answers, from what it has read
            log.warning("could not read the end of `%s`: %s", topics.RESPONSES.name, exc)
            return
        await self._follower.applied(ends, deadline - loop.time())

    def start(self) -> None:
        self._follower.start()

    def _handle(self, msg) -> None:
        if msg.value() is None:
            return  # a tombstone (compaction's own deletes); our deletes are records
        event = self.dead_letters.decode(msg, ("StoredResponse",))
        if event is None:
            return
        problem = checks.response_key_problem(event.record, msg.key())
        if problem:
            self.dead_letters.send(msg, problem)
            return
        self.store.apply(codec.record_of(event, StoredResponse), (msg.partition(), msg.offset()))

    # --- records evicted from memory, read back from the topic ---
    async def record(self, tenant_id: str, response_id: str, reads: KafkaReads) -> StoredResponse | None:
        """The tenant's stored response (None: there is none), read back from the topic if it was evicted."""
        for _ in range(3):  # a newer record of the id may replace the one being read back meanwhile
            try:
                return self.store.get(tenant_id, response_id)
            except Evicted as evicted:
                for record in await self._read_back([evicted], reads):
                    if record["response_id"] == response_id and record["tenant_id"] == tenant_id:
                        return record
        return None

    async def chain(self, tenant_id: str, response_id: str, reads: KafkaReads) -> list[StoredResponse]:
        """`ResponseStore.chain`, its evicted turns read back (they need not all fit the memory bound at once)."""
        fetched: dict[str, StoredResponse] = {}
        for _ in range(3):
            try:
                return self.store.chain(tenant_id, response_id, fetched)
            except Evicted:
                missing = [e for e in self.store.missing_links(tenant_id, response_id) if e.response_id not in fetched]
                for record in await self._read_back(missing, reads):
                    fetched[record["response_id"]] = record
        return self.store.chain(tenant_id, response_id, fetched)

    async def _read_back(self, evicted: list[Evicted], reads: KafkaReads) -> list[StoredResponse]:
        found = await reads.run(self._fetch, [e.at for e in evicted], reads)
        for record, at in found:
            self.store.restore(record, at)
        return [record for record, _ in found]

    def _fetch(self, places: list[tuple[int, int]], reads: KafkaReads,
               timeout: float = 5.0) -> list[tuple[StoredResponse, tuple[int, int]]]:
        """The records at these (partition, offset) places of `responses` (blocking: on the read pool). A place
        compaction removed (a newer record replaced it) is left out."""
        found: list[tuple[StoredResponse, tuple[int, int]]] = []
        consumer = reads.consumers.take()
        try:
            for partition, offset in places:
                consumer.assign([TopicPartition(topics.RESPONSES.name, partition, offset)])
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    msg = consumer.poll(0.2)
                    if msg is None or msg.topic() != topics.RESPONSES.name or msg.partition() != partition:
                        continue
                    if msg.error() is not None:
                        break  # the partition's end: nothing there any more
                    at = msg.offset()
                    if at is None or at < offset:
                        continue
                    if at == offset and msg.value() is not None:
                        event = codec.decode(msg.value(), msg.headers(), expect=("StoredResponse",), check=True)
                        found.append((codec.record_of(event, StoredResponse), (partition, offset)))
                    break
        finally:
            reads.consumers.give_back(consumer)
        return found

    def stop(self) -> None:
        self._follower.stop()
