"""The streams process (a Faust app): the authoritative gate in front of the GPU pool.

Faust gives us two things here: group membership (who is active, who is standby) and
a changelog-backed table (the scheduler's durable state). The scheduling itself runs
in ``OwnerLoop`` (owner.py) on the instance that holds partition 0 of the one-partition
internal topic ``<app id>-scheduler``:

* the state table has one partition too, so Faust co-partitions it with the scheduler
  topic: the instance that owns the scheduler partition is the table's active owner,
  and every other instance in the group keeps a hot standby copy
  (``table_standby_replicas=1``) and does nothing else;
* after each rebalance Faust recovers the table and calls ``on_recover``; the instance
  that now holds the scheduler partition rebuilds the queue and ledger from the table
  and starts releasing; an instance that loses it stops before the partition moves
  (``on_partitions_revoked``), so two instances never release at the same time
  (barring a stalled process outliving its session timeout, see docs/streams.md).

Nothing is ever sent to the scheduler topic; it exists to be owned.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

import faust
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic
from faust.types import TP

from infra import kafka_clients
from schemas import topics
from streams import metrics as metrics_mod
from streams.config import RECOVERY_EXIT_CODE, StreamsSettings
from streams.owner import OwnerLoop

log = logging.getLogger("tokenmill.streams")

STATE_TABLE = "state"


def ensure_topics(settings: StreamsSettings) -> None:
    """Create the internal topics (and, under a topic prefix, the public ones)."""
    admin = AdminClient({"bootstrap.servers": kafka_clients.bootstrap_servers()})
    existing = set(admin.list_topics(timeout=30).topics)
    wanted = [
        NewTopic(settings.scheduler_topic, num_partitions=1, replication_factor=1,
                 config={"cleanup.policy": "delete", "retention.ms": str(3600 * 1000)}),
        NewTopic(settings.state_changelog_topic, num_partitions=1, replication_factor=1,
                 config={"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1",
                         "segment.ms": str(600 * 1000)}),
    ]
    if settings.topic_prefix:
        wanted += [NewTopic(settings.topic(spec), num_partitions=spec.partitions, replication_factor=1,
                            config=spec.config()) for spec in topics.ALL_TOPICS]
    wanted = [t for t in wanted if t.topic not in existing]
    if not wanted:
        return
    for name, future in admin.create_topics(wanted, request_timeout=30).items():
        try:
            future.result()
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def create_app(app_id: str | None = None, settings: StreamsSettings | None = None) -> faust.App:
    settings = settings or StreamsSettings()
    if app_id is not None and app_id != settings.app_id:
        settings = StreamsSettings(app_id=app_id)
    ensure_topics(settings)
    bootstrap = kafka_clients.bootstrap_servers()
    app = faust.App(
        settings.topic_prefix + settings.app_id,
        broker=",".join(f"kafka://{b}" for b in bootstrap.split(",")),
        key_serializer="raw",
        value_serializer="raw",
        producer_acks=-1,
        producer_linger=0.0,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        topic_allow_declare=False,
        topic_disable_leader=True,
        broker_commit_every=100,
        broker_commit_interval=0.5,
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=max(0.3, settings.session_timeout_s / 6),
        store="memory://",
        table_standby_replicas=1,
    )
    scheduler_topic = app.topic(settings.scheduler_topic, key_type=bytes, value_type=bytes, partitions=1)
    changelog = app.topic(settings.state_changelog_topic, key_type=bytes, value_type=bytes, partitions=1,
                          compacting=True, deleting=False)
    table = app.Table(STATE_TABLE, partitions=1, key_type=bytes, value_type=bytes, changelog_topic=changelog)
    # One partition: every entry lives in changelog partition 0, so the table can be
    # written from the owner loop, outside Faust's stream iteration.
    table.partition_for_key = lambda key: 0
    scheduler_tp = TP(settings.scheduler_topic, 0)
    metrics = metrics_mod.StreamsMetrics()
    metrics.set_active(False)
    holder: dict[str, OwnerLoop | None] = {"owner": None}
    lock = asyncio.Lock()

    def persist(dirty: dict[str, Any]) -> None:
        for key, value in dirty.items():
            k = key.encode()
            if value is None:
                if k in table:
                    del table[k]
            else:
                table[k] = _encode(value)

    def load_state() -> dict[str, Any]:
        return {k.decode(): json.loads(v) for k, v in table.items()}

    async def stop_owner(reason: str) -> None:
        async with lock:
            owner, holder["owner"] = holder["owner"], None
            if owner is not None:
                log.warning("giving up the scheduler (%s)", reason)
                metrics.set_active(False)
                await owner.stop()

    @table.on_recover
    async def on_recovered() -> None:
        active = scheduler_tp in app.assignor.assigned_actives()
        if not active:
            await stop_owner("not assigned")
            log.warning("standby: the scheduler is owned by another instance")
            return
        async with lock:
            if holder["owner"] is not None:
                return
            owner = OwnerLoop(settings, load_state(), persist, metrics)
            await owner.start()
            holder["owner"] = owner
            metrics.set_active(True)

    @app.on_before_shutdown.connect
    async def on_shutdown(app_, **kwargs) -> None:
        await stop_owner("shutting down")

    @app.on_partitions_revoked.connect
    async def on_revoked(app_, revoked, **kwargs) -> None:
        if scheduler_tp in revoked:
            await stop_owner("partition revoked")

    @app.agent(scheduler_topic)
    async def scheduler_ownership(stream):
        async for _ in stream:  # nothing is sent here; the partition is what matters
            pass

    @app.task
    async def start_metrics() -> None:
        # The Faust worker sets the root logger to WARNING; our lifecycle lines are INFO.
        logging.getLogger("tokenmill.streams").setLevel(logging.INFO)
        metrics_mod.serve(settings.metrics_port)

    @app.timer(interval=0.25)
    async def refresh_metrics() -> None:
        owner = holder["owner"]
        if owner is not None:
            metrics.observe_gate(owner.gate, metrics_mod.now(), force=True)

    stuck_since: dict[str, float | None] = {"t": None}

    @app.timer(interval=1.0)
    async def recovery_watchdog() -> None:
        # Faust's table recovery can wait forever for changelog events that never come (seen when an
        # instance gets the scheduler back right after giving it up). Holding the partition without
        # running the scheduler stalls every request, so past a deadline this instance exits and the
        # partition moves to a standby (or to this process's restart under a supervisor).
        holding = scheduler_tp in app.assignor.assigned_actives() and holder["owner"] is None
        if not holding:
            stuck_since["t"] = None
            return
        stuck_since["t"] = stuck_since["t"] or time.monotonic()
        if time.monotonic() - stuck_since["t"] > settings.recovery_timeout_s:
            log.error("scheduler partition held for %.0f s without finishing recovery; exiting so another "
                      "instance takes over", settings.recovery_timeout_s)
            logging.shutdown()
            os._exit(RECOVERY_EXIT_CODE)

    app.tokenmill_holder = holder  # for tests and debugging
    return app


def main(argv: list[str] | None = None) -> None:
    app = create_app()
    app.main()
