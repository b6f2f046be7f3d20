"""Kafka client settings shared by every confluent-kafka producer and consumer.

Defaults favour latency: every hop of the token path sits between a client and its first
token, so producers linger one millisecond at most and Nagle's algorithm is off. A fetch with
fetch.min.bytes=1 is answered the moment a record is appended, so fetch.wait.max.ms only bounds
how often an idle consumer asks again: 100 ms, because a few ms made a dozen idle consumers keep
the broker busy with empty fetches (half a core of a 2-core machine) at no gain in latency.
After a broker restart every client tries again at least once a second (librdkafka backs off
up to 10 s by default), so the stack serves again within a second or two of the broker.
"""
from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from confluent_kafka import KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from infra import settings
from infra.kafka import security as kafka_security
from schemas import codec, topics

log = logging.getLogger(__name__)


def bootstrap_servers() -> str:
    return settings.BOOTSTRAP_SERVERS.get()


def produce_arguments(key=None, value=None, headers=None, partition: int | None = None) -> dict[str, Any]:
    """A produce() call's keyword arguments, headers and partition only when given: what the wrappers that keep
    a record to produce it again (the resilient producer, the owner's transaction) store."""
    kwargs: dict[str, Any] = {"key": key, "value": value}
    if headers is not None:
        kwargs["headers"] = headers
    if partition is not None:
        kwargs["partition"] = partition
    return kwargs


def producer_config(client_id: str, **overrides: Any) -> dict[str, Any]:
    cfg = {
        "bootstrap.servers": bootstrap_servers(),
        "client.id": client_id,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 1,
        "socket.nagle.disable": True,
        "reconnect.backoff.max.ms": 1000,
        **kafka_security.librdkafka_settings(),
    }
    cfg.update(overrides)
    return cfg


def admin_config(bootstrap: str | None = None) -> dict[str, Any]:
    """An AdminClient's configuration (same cluster, same credentials as every other client)."""
    return {"bootstrap.servers": bootstrap or bootstrap_servers(), **kafka_security.librdkafka_settings()}


def consumer_config(group_id: str | None, client_id: str, **overrides: Any) -> dict[str, Any]:
    cfg = {
        "bootstrap.servers": bootstrap_servers(),
        "client.id": client_id,
        # Offsets are committed by hand, after the work a message asked for is done.
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        # librdkafka's default, pinned: the gate writes in transactions, and a stalled gate's
        # fenced-out writes must never be seen (streams/owner_transaction.py).
        "isolation.level": "read_committed",
        "fetch.wait.max.ms": 100,
        "fetch.min.bytes": 1,
        "socket.nagle.disable": True,
        "session.timeout.ms": 10000,
        "heartbeat.interval.ms": 1000,
        "partition.assignment.strategy": "cooperative-sticky",
        "reconnect.backoff.max.ms": 1000,
        **kafka_security.librdkafka_settings(),
    }
    if group_id is None:
        cfg["group.id"] = f"unused-{client_id}"  # librdkafka insists on one even for assign()
    else:
        cfg["group.id"] = group_id
    cfg.update(overrides)
    return cfg


def with_retries(fn, what: str, timeout: float = 60.0):
    """Call fn until it succeeds: metadata calls fail for a while when a broker restarts or a
    partition's leader moves, and a process starting at that moment should wait, not die."""
    import time

    deadline = time.monotonic() + timeout
    delay = 0.2
    while True:
        try:
            return fn()
        except KafkaException as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s failed (%s); retrying", what, exc)
            time.sleep(delay)
            delay = min(delay * 2, 3.0)


MAX_REPLICATION = 3


def broker_answers(client, timeout: float = 0.5) -> bool:
    """Whether a metadata request through this client (producer or consumer) gets an answer now. The client
    asks through itself: a broken client can say "no" while the broker is up, so callers bound how long
    they believe it."""
    try:
        client.list_topics(timeout=timeout)
        return True
    except KafkaException:
        return False


def replication_for(admin: AdminClient, metadata=None, timeout: float = 10.0) -> tuple[int, dict[str, str]]:
    """(replication factor, topic settings) for a new topic on the cluster `admin` talks to.

    The factor is min(3, the brokers the cluster's metadata names), or TOKENMILL_KAFKA_REPLICATION;
    with 3 replicas or more a write needs 2 of them in sync (acks=all, see producer_config), so one
    broker may be lost without losing an acknowledged write or refusing new ones. `metadata`: a
    list_topics() answer the caller already has."""
    if settings.KAFKA_REPLICATION.is_set():
        factor = settings.KAFKA_REPLICATION.get()
    else:
        if metadata is None:
            metadata = with_retries(lambda: admin.list_topics(timeout=timeout), "reading cluster metadata")
        factor = max(1, min(MAX_REPLICATION, len(metadata.brokers)))
    return factor, {"min.insync.replicas": "2" if factor >= 3 else "1"}


def create_topics(bootstrap: str | None = None, timeout: float = 30.0) -> list[str]:
    """Create every declared topic that does not exist yet; return the ones created."""
    admin = AdminClient(admin_config(bootstrap))
    metadata = admin.list_topics(timeout=timeout)
    existing = set(metadata.topics)
    factor, replicated = replication_for(admin, metadata)
    wanted = [
        NewTopic(spec.name, num_partitions=spec.partitions, replication_factor=factor,
                 config={**spec.config(), **replicated})
        for spec in topics.ALL_TOPICS
        if spec.name not in existing
    ]
    created = []
    for name, future in (admin.create_topics(wanted, request_timeout=timeout).items() if wanted else []):
        try:
            future.result()
            created.append(name)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
    return created


def trace_header(request_id: str | None) -> tuple[str, bytes] | None:
    """A W3C `traceparent` whose trace id is the request id, so one request is one trace on every hop."""
    if not request_id:
        return None
    trace_id = request_id if len(request_id) == 32 and all(c in "0123456789abcdef" for c in request_id) \
        else hashlib.sha256(request_id.encode()).hexdigest()[:32]
    return "traceparent", f"00-{trace_id}-{os.urandom(8).hex()}-01".encode()


def produce_event(producer: Producer, topic: str, key: str | bytes | None, name: str,
                  record: dict[str, Any], partition: int | None = None, on_delivery=None) -> None:
    value, headers = codec.encode(name, record)
    trace = trace_header(record.get("request_id"))
    if trace is not None:
        headers.append(trace)
    kwargs: dict[str, Any] = {"key": key, "value": value, "headers": headers}
    if partition is not None:
        kwargs["partition"] = partition
    if on_delivery is not None:
        kwargs["on_delivery"] = on_delivery
    while True:
        try:
            producer.produce(topic, **kwargs)
            return
        except BufferError:  # local queue full: let deliveries drain, then retry
            producer.poll(0.05)


def dead_letter(producer: Producer, msg: Message, consumer: str, reason: str) -> None:
    """Park an unprocessable message with the reason, so the consumer can go on."""
    log.warning("dead-lettering %s[%s]@%s: %s", msg.topic(), msg.partition(), msg.offset(), reason)
    record = codec.new_event(
        "DeadLetter",
        source_topic=msg.topic(), source_partition=msg.partition(), source_offset=msg.offset(),
        consumer=consumer, reason=reason[:2000], key=msg.key(), value=msg.value(),
    )
    produce_event(producer, topics.DEAD_LETTERS.name, msg.key(), "DeadLetter", record)


def decode_or_dead_letter(producer: Producer, msg: Message, consumer: str,
                          expect: tuple[str, ...] | None = None) -> codec.Event | None:
    """The decoded event, or None after dead-lettering a message that is undecodable, does not
    belong on its topic, or holds impossible values (schemas/checks.py)."""
    return DeadLetters(consumer, producer).decode(msg, expect)


class DeadLetters:
    """Where one consumer parks what it cannot use. It produces with the consumer's own producer
    when it has one, else with one made on first use.

    Without a client id (e.g. a one-shot CLI reading a view) it only logs what it would park."""

    def __init__(self, client_id: str | None, producer: Producer | None = None):
        self.client_id = client_id
        self.count = 0
        self._producer = producer

    def send(self, msg: Message, reason: str) -> None:
        self.count += 1
        if self.client_id is None:
            log.warning("skipping unprocessable %s[%s]@%s: %s", msg.topic(), msg.partition(), msg.offset(), reason)
            return
        if self._producer is None:
            self._producer = Producer(producer_config(f"{self.client_id}-dead-letters"))
        dead_letter(self._producer, msg, self.client_id, reason)
        self._producer.poll(0)

    def decode(self, msg: Message, expect: tuple[str, ...] | None) -> codec.Event | None:
        """The decoded event, or None after parking a message that is undecodable, does not belong
        on its topic (`expect`), or holds impossible values (schemas/checks.py)."""
        try:
            return codec.decode(msg.value(), msg.headers(), expect=expect, check=True)
        except codec.UndecodableEvent as exc:
            self.send(msg, str(exc))
            return None

    def unprocessable(self, msg: Message, exc: BaseException) -> None:
        self.send(msg, f"unprocessable: {type(exc).__name__}: {exc}")

    def flush(self, timeout: float = 10.0) -> None:
        if self._producer is not None:
            self._producer.flush(timeout)
