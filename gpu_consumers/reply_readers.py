"""Which reply addresses still have a reader.

Each ingress process beats on `ingress-heartbeats` for its reply partition. A request
whose ingress stopped beating, said it is stopping, or was replaced by a newer process
on the same partition has nobody left to stream to; the worker cancels it and frees
its slot instead of generating into the void.

Silence only means death if the beats could have reached us. While the broker is away (a
restart, a partition) no beat arrives from anyone, and the ingress processes queue theirs in
their producers until it is back. So staleness is judged against the last moment this view was
known complete (read to the end of the topic, as the broker then reported it), not against the
clock: a broker outage pauses the verdict instead of cancelling every request in flight.

Nor does silence count from before the view came back. When the broker returns, this reader
may confirm the view before an ingress process has reconnected and delivered a fresh beat; its
last beat is then old, though it is alive. So silence is counted from the later of its last beat
and the first confirmation after the broker was last unreachable, plus a reconnect grace. (A
reader thread that was merely slow, on a busy machine, does not restart that clock: only a broker
that did not answer does.)
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from schemas import topics

log = logging.getLogger(__name__)

# The two errors cost differently: a verdict a few seconds late generates a few seconds for nobody in one
# slot; a verdict on a live ingress whose beats were only late (its event loop held up on a machine loaded
# far past its cores) ends a request its client is still reading, which then times out. Hence 10 s, not 5.
MISSED_BEATS = 10
CONFIRM_INTERVAL_S = 0.25
# After the view comes back, how long an ingress process gets to reconnect and beat again
# (its client retries a connection at least every second: infra/kafka/clients.py).
RECONNECT_GRACE_MS = 3_000
# The broker answers but the view cannot be read to its end for this long: the client is stuck
# (a partition left unfetched after a broker restart, see infra/kafka/fetch_watch.py); use a new one.
STUCK_AFTER_S = 3.0
# The broker does not answer this client for this long: replace the client, in case it is the client
# (it asks through itself; seen: a heartbeat reader whose every end-offset query failed long after the
# broker was back, so no verdict was ever given again and dead ingresses' requests ran to the end).
UNANSWERED_REPLACE_S = 5.0


@dataclass
class Beat:
    incarnation: str
    timestamp_ms: int
    interval_ms: int
    stopping: bool


class HeartbeatTable:
    """The latest beat per reply address, and the verdict on a request (pure, no I/O)."""

    def __init__(self):
        self.beats: dict[tuple[str, int], Beat] = {}
        self.complete_as_of_ms: int | None = None  # every beat produced before this moment is in `beats`
        self.confirmed_since_ms: int | None = None  # first confirmation since the broker was last unreachable
        self._cut_off = True

    def mark_unreachable(self) -> None:
        """The broker did not answer: whatever silence follows may be the outage's, not the reader's."""
        self._cut_off = True

    def mark_complete(self, as_of_ms: int) -> None:
        if self._cut_off:
            self.confirmed_since_ms = as_of_ms
            self._cut_off = False
        if self.complete_as_of_ms is None or as_of_ms > self.complete_as_of_ms:
            self.complete_as_of_ms = as_of_ms

    def observe(self, beat: dict) -> None:
        address = (beat["reply_topic"], beat["reply_partition"])
        known = self.beats.get(address)
        if known is None or beat["timestamp_ms"] >= known.timestamp_ms:
            self.beats[address] = Beat(beat["incarnation"], beat["timestamp_ms"], beat["interval_ms"],
                                       beat["stopping"])

    def gone(self, record: dict) -> bool:
        """Whether nobody will read this request's replies any more."""
        incarnation = record.get("reply_incarnation")
        if incarnation is None:  # batch results are collected later, from the topic
            return False
        beat = self.beats.get((record["reply_topic"], record["reply_partition"]))
        if beat is None:
            return False
        if beat.incarnation != incarnation:
            # a newer process took the partition over after this request arrived
            return beat.timestamp_ms > record["arrived_at_ms"]
        if beat.stopping:
            return True
        if self.complete_as_of_ms is None or self.confirmed_since_ms is None:  # not yet read to the end:
            return False  # silence proves nothing (the first completion sets both)
        silent_since = max(beat.timestamp_ms, self.confirmed_since_ms + RECONNECT_GRACE_MS)
        return self.complete_as_of_ms - silent_since > MISSED_BEATS * beat.interval_ms


class ReplyReaders(HeartbeatTable):
    """A HeartbeatTable kept current from the `ingress-heartbeats` topic by a background thread.

    The thread owns the consumer. Besides reading beats it asks the broker for the end of every
    partition every quarter second; when it has read up to those ends, the view is complete as of the
    moment it asked. Broker calls block, which is why they are not made on the engine's loop.
    """

    def __init__(self, client_id: str):
        super().__init__()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._client_id = client_id
        self._consumer = Consumer(kafka_clients.consumer_config(None, f"{client_id}-heartbeats"))
        self._unconfirmed_since: float | None = None
        self._unanswered_since: float | None = None
        self._dead_letters = kafka_clients.DeadLetters(f"{client_id}-heartbeats")
        self._ends = topic_reader.EndProbe(f"{client_id}-heartbeats-ends")  # see EndProbe: not the fetching client
        meta = kafka_clients.with_retries(
            lambda: self._consumer.list_topics(topics.INGRESS_HEARTBEATS.name, timeout=10),
            "reading `ingress-heartbeats` metadata").topics[topics.INGRESS_HEARTBEATS.name]
        self._partitions = [TopicPartition(topics.INGRESS_HEARTBEATS.name, p) for p in meta.partitions]
        self._consumer.assign([TopicPartition(tp.topic, tp.partition, OFFSET_BEGINNING) for tp in self._partitions])
        self._next_offset: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, name="reply-readers", daemon=True)
        self._thread.start()

    def gone(self, record: dict) -> bool:
        with self._lock:
            return super().gone(record)

    def _read_available(self, timeout: float) -> None:
        for msg in self._consumer.consume(num_messages=500, timeout=timeout):
            partition, offset = msg.partition(), msg.offset()
            if msg.error() or partition is None or offset is None:
                continue
            self._next_offset[partition] = offset + 1
            if msg.value() is None:
                continue
            event = self._dead_letters.decode(msg, ("IngressHeartbeat",))
            if event is None:
                continue  # the address keeps its last good beat
            try:
                with self._lock:
                    self.observe(event.record)
            except Exception as exc:
                self._dead_letters.unprocessable(msg, exc)

    def _confirm_complete(self) -> None:
        asked_ms = int(time.time() * 1000)
        try:
            ends = self._ends.bounds(topics.INGRESS_HEARTBEATS.name, [tp.partition for tp in self._partitions],
                                     timeout=2.0)
        except KafkaException:
            # The broker is unreachable: the view stays complete only as of the last confirmation.
            with self._lock:
                self.mark_unreachable()
            now = time.monotonic()
            self._unanswered_since = self._unanswered_since or now
            if now - self._unanswered_since > UNANSWERED_REPLACE_S:
                self._replace_consumer()  # harmless in a real outage: the new client waits as well
                self._unanswered_since = now
            return
        self._unanswered_since = None
        # Beats keep landing while we ask; read up to the ends we were told (briefly), and the view
        # is then complete as of the moment we asked.
        give_up = time.monotonic() + 0.5
        while not all(self._next_offset.get(p, low) >= high for p, (low, high) in ends.items()):
            if time.monotonic() > give_up:
                # The broker answers, but what it holds does not arrive: past a bound, a stuck client.
                self._unconfirmed_since = self._unconfirmed_since or time.monotonic()
                if time.monotonic() - self._unconfirmed_since > STUCK_AFTER_S:
                    self._replace_consumer()
                return
            self._read_available(timeout=0.05)
        self._unconfirmed_since = None
        with self._lock:
            self.mark_complete(asked_ms)

    def _replace_consumer(self) -> None:
        """A heartbeat partition left unfetched after a broker restart (infra/kafka/fetch_watch.py) would
        pause every verdict for good: no confirmation could complete again."""
        log.warning("`ingress-heartbeats` has beats this worker cannot read to the end; reading on with a new client")
        self._consumer.close()
        self._ends.close()  # its client too: the next query opens a fresh one
        self._consumer = Consumer(kafka_clients.consumer_config(None, f"{self._client_id}-heartbeats"))
        self._consumer.assign([TopicPartition(tp.topic, tp.partition, self._next_offset.get(tp.partition,
                                                                                            OFFSET_BEGINNING))
                               for tp in self._partitions])
        self._unconfirmed_since = None

    def _run(self) -> None:
        last_confirm = 0.0
        while not self._stop.is_set():
            try:
                self._read_available(timeout=0.1)
                if time.monotonic() - last_confirm >= CONFIRM_INTERVAL_S:
                    last_confirm = time.monotonic()
                    self._read_available(timeout=0)
                    self._confirm_complete()
            except Exception:  # pragma: no cover - keep the verdicts paused rather than kill the worker
                log.exception("reading ingress heartbeats failed")
                time.sleep(1.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()
        self._ends.close()
        self._dead_letters.flush()
