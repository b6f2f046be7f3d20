"""The streams process (a Faust app): the authoritative gate in front of the GPU pool.

Faust gives us group membership: who is active, who is standby. The scheduling itself runs
in ``OwnerLoop`` (owner.py) on the instance that holds partition 0 of the one-partition
internal topic ``<app id>-scheduler``; nothing is ever sent to that topic, it exists to be owned.

* The gate's state lives in a compacted topic of our own (state_store.py), which every
  instance follows in the background, so a standby is hot. Faust's tables are not used: their
  recovery could wait forever after a broker restart (docs/streams.md).
* When Faust assigns the scheduler partition to this instance (``on_partitions_assigned``), it
  takes the gate's transactional id over, reads the state topic to its end and starts the owner
  loop; when the partition is revoked, the loop stops (and commits) before the rebalance can hand
  it on. A stalled process that outlives its session timeout and wakes still believing it owns
  the queue is fenced: the new owner's takeover made its transaction void (owner_transaction.py).
* A watchdog (watchdog.py) ends the process when it is stuck in any way that keeps requests
  from being released; ``tokenmill serve streams`` starts it again.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import faust
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic
from faust.types import TP

from infra import kafka_clients, kafka_security
from infra.paths import LOCAL_DIR
from schemas import topics
from streams import metrics as metrics_mod
from streams.config import RECOVERY_EXIT_CODE, StreamsSettings
from streams.owner import OwnerLoop, open_transaction
from streams.state_store import StateFollower
from streams.watchdog import Observation, Watchdog

log = logging.getLogger("tokenmill.streams")


def ensure_topics(settings: StreamsSettings) -> None:
    """Create the internal topics (and, under a topic prefix, the public ones)."""
    admin = AdminClient(kafka_clients.admin_config())
    # A process may start while the broker restarts: wait for it rather than die.
    metadata = kafka_clients.with_retries(lambda: admin.list_topics(timeout=10), "listing topics")
    existing = set(metadata.topics)
    factor, replicated = kafka_clients.replication_for(admin, metadata)
    wanted = [
        NewTopic(settings.scheduler_topic, num_partitions=1, replication_factor=factor,
                 config={"cleanup.policy": "delete", "retention.ms": str(3600 * 1000), **replicated}),
        NewTopic(settings.state_topic, num_partitions=1, replication_factor=factor,
                 config={"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1",
                         "segment.ms": str(600 * 1000), **replicated}),
    ]
    if settings.topic_prefix:
        wanted += [NewTopic(settings.topic(spec), num_partitions=spec.partitions, replication_factor=factor,
                            config={**spec.config(), **replicated}) for spec in topics.ALL_TOPICS]
    wanted = [t for t in wanted if t.topic not in existing]
    if not wanted:
        return
    for name, future in admin.create_topics(wanted, request_timeout=30).items():
        try:
            future.result()
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise


def create_app(app_id: str | None = None, settings: StreamsSettings | None = None) -> faust.App:
    settings = settings or StreamsSettings()
    if app_id is not None and app_id != settings.app_id:
        settings = StreamsSettings(app_id=app_id)
    ensure_topics(settings)
    bootstrap = kafka_clients.bootstrap_servers()
    datadir = LOCAL_DIR / "streams-data"
    datadir.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        settings.topic_prefix + settings.app_id,
        broker=",".join(f"kafka://{b}" for b in bootstrap.split(",")),
        broker_credentials=kafka_security.faust_credentials(),
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
        # Faust keeps nothing there (tables are in memory) but still makes the folder; without
        # this it lands in the working directory, one per topic prefix.
        datadir=str(datadir / (settings.topic_prefix + settings.app_id)),
    )
    scheduler_topic = app.topic(settings.scheduler_topic, key_type=bytes, value_type=bytes, partitions=1)
    scheduler_tp = TP(settings.scheduler_topic, 0)
    metrics = metrics_mod.StreamsMetrics()
    metrics.set_active(False)
    follower = StateFollower(settings.state_topic, settings.topic_prefix + settings.app_id)
    holder: dict[str, Any] = {"owner": None, "holds": False, "takeover": None}
    lock = asyncio.Lock()

    async def stop_owner(reason: str) -> None:
        async with lock:
            owner, holder["owner"] = holder["owner"], None
            if owner is not None:
                log.warning("giving up the scheduler (%s)", reason)
                metrics.set_active(False)
                await owner.stop()
                follower.resume()  # a standby follows the state again, to be hot for a later takeover

    def fenced() -> None:
        # Another instance holds the transactional id: this one stalled past its session and was
        # replaced. Start afresh (the supervisor restarts the process), to rejoin as a standby.
        log.error("fenced by a newer owner; exiting to rejoin the group as a standby")
        logging.shutdown()
        os._exit(RECOVERY_EXIT_CODE)

    async def take_over() -> None:
        # Retried until it works or the partition goes; the watchdog bounds how long that may take.
        while holder["holds"]:
            async with lock:
                if holder["owner"] is not None or not holder["holds"]:
                    return
                try:
                    # The transactional id first: it fences the previous owner and aborts what it
                    # left open, and the state's last records can only be read after that.
                    transaction = await asyncio.to_thread(open_transaction, settings)
                    state = await asyncio.to_thread(follower.snapshot, settings.recovery_timeout_s / 2)
                    owner = OwnerLoop(settings, state, metrics, transaction, on_fenced=fenced)
                    await owner.start()
                except Exception:
                    log.exception("taking the scheduler over failed; trying again")
                else:
                    holder["owner"] = owner
                    metrics.set_active(True)
                    follower.pause()
                    return
            await asyncio.sleep(1.0)

    @app.on_partitions_assigned.connect
    async def on_assigned(app_, assigned, **kwargs) -> None:
        holder["holds"] = scheduler_tp in assigned
        if not holder["holds"]:
            await stop_owner("not assigned")
            log.warning("standby: the scheduler is owned by another instance")
            return
        # Not awaited here: Faust's rebalance callback must return, and the takeover reads Kafka.
        task = holder["takeover"]
        if task is None or task.done():
            holder["takeover"] = asyncio.ensure_future(take_over())

    @app.on_partitions_revoked.connect
    async def on_revoked(app_, revoked, **kwargs) -> None:
        if scheduler_tp in revoked:
            holder["holds"] = False
            await stop_owner("partition revoked")

    @app.on_before_shutdown.connect
    async def on_shutdown(app_, **kwargs) -> None:
        holder["holds"] = False
        await stop_owner("shutting down")
        await asyncio.to_thread(follower.close)

    # concurrency=1 (Faust's default, pinned): nothing flows here, but an agent with more would
    # let Faust commit past messages not yet processed (faust-streaming issue 606).
    @app.agent(scheduler_topic, concurrency=1)
    async def scheduler_ownership(stream):
        async for _ in stream:  # nothing is sent here; the partition is what matters
            pass

    @app.task
    async def start_metrics() -> None:
        # The Faust worker sets the root logger to WARNING; our lifecycle lines are INFO.
        logging.getLogger("tokenmill.streams").setLevel(logging.INFO)
        metrics_mod.serve(settings.metrics_port)
        log.warning("started; joining the streams group")

    @app.timer(interval=0.25)
    async def refresh_metrics() -> None:
        owner = holder["owner"]
        if owner is not None:
            try:
                metrics.observe_gate(owner.gate, metrics_mod.now(), force=True)
            except Exception:  # a metrics bug must never stop the scheduler (a Faust timer's error crashes the app)
                log.exception("refreshing the queue metrics failed")

    watchdog = Watchdog(settings.recovery_timeout_s)

    @app.timer(interval=1.0)
    async def stuck_watchdog() -> None:
        owner = holder["owner"]
        why = watchdog.verdict(Observation(
            now=time.monotonic(), rebalancing=bool(app.rebalancing), holds_scheduler=holder["holds"],
            owner_running=owner is not None, last_iteration_at=owner.last_iteration_at if owner else None))
        if why is not None:
            log.error("stuck: %s; exiting so that this instance starts afresh (or a standby takes over)", why)
            logging.shutdown()
            os._exit(RECOVERY_EXIT_CODE)

    return app


def main(argv: list[str] | None = None) -> None:
    app = create_app()
    app.main()
