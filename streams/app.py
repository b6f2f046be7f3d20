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
import faust
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic
from faust.types import TP

from infra.kafka import clients as kafka_clients
from infra.kafka import security as kafka_security
from infra.paths import local_dir
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


def faust_app(settings: StreamsSettings) -> faust.App:
    """The Faust app, configured for a group whose only job is to own one partition (no tables)."""
    bootstrap = kafka_clients.bootstrap_servers()
    datadir = local_dir() / "streams-data"
    datadir.mkdir(parents=True, exist_ok=True)
    return faust.App(
        settings.topic_prefix + settings.app_id,
        broker=",".join(f"kafka://{b}" for b in bootstrap.split(",")),
        broker_credentials=kafka_security.faust_credentials(),
        key_serializer="raw",
        value_serializer="raw",
        producer_acks=-1,
        producer_linger=0.0,
        consumer_auto_offset_reset="earliest",
        # The group's leader assigns only the topics in its consumer's metadata. A scheduler topic that
        # ensure_topics created a moment before the first join can be missing from it (seen on a fresh
        # broker: "Ignoring missing topic" at the join and at the next rebalance 12 s later), and then no
        # instance owns the scheduler until that metadata is refreshed: Faust's default is every 5
        # minutes, with nothing released meanwhile. A refresh that finds the topic triggers a rejoin.
        consumer_metadata_max_age_ms=5000,
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


def exit_fenced() -> None:
    # Another instance holds the transactional id: this one stalled past its session and was
    # replaced. Start afresh (the supervisor restarts the process), to rejoin as a standby.
    log.error("fenced by a newer owner; exiting to rejoin the group as a standby")
    logging.shutdown()
    os._exit(RECOVERY_EXIT_CODE)


class SchedulerOwnership:
    """Whether this instance holds the scheduler partition, and the owner loop it runs while it does:
    taken over when Faust assigns the partition, stopped when it is revoked or the process stops."""

    def __init__(self, settings: StreamsSettings, metrics: metrics_mod.StreamsMetrics, follower: StateFollower):
        self.settings = settings
        self.metrics = metrics
        self.follower = follower
        self.scheduler_tp = TP(settings.scheduler_topic, 0)
        self.owner: OwnerLoop | None = None
        self.holds = False
        self._takeover: asyncio.Future | None = None
        self._lock = asyncio.Lock()

    async def stop_owner(self, reason: str) -> None:
        async with self._lock:
            owner, self.owner = self.owner, None
            if owner is not None:
                log.warning("giving up the scheduler (%s)", reason)
                self.metrics.set_active(False)
                await owner.stop()
                self.follower.resume()  # a standby follows the state again, to be hot for a later takeover

    async def take_over(self) -> None:
        # Retried until it works or the partition goes; the watchdog bounds how long that may take.
        settings = self.settings
        while self.holds:
            async with self._lock:
                if self.owner is not None or not self.holds:
                    return
                try:
                    # The transactional id first: it fences the previous owner and aborts what it
                    # left open, and the state's last records can only be read after that.
                    transaction = await asyncio.to_thread(open_transaction, settings)
                    state = await asyncio.to_thread(self.follower.snapshot, settings.recovery_timeout_s / 2)
                    owner = OwnerLoop(settings, state, self.metrics, transaction, on_fenced=exit_fenced)
                    await owner.start()
                except Exception:
                    log.exception("taking the scheduler over failed; trying again")
                else:
                    self.owner = owner
                    self.metrics.set_active(True)
                    self.follower.pause()
                    return
            await asyncio.sleep(1.0)

    async def on_assigned(self, app_, assigned, **kwargs) -> None:
        self.holds = self.scheduler_tp in assigned
        if not self.holds:
            await self.stop_owner("not assigned")
            log.warning("standby: the scheduler is owned by another instance")
            return
        # Not awaited here: Faust's rebalance callback must return, and the takeover reads Kafka.
        task = self._takeover
        if task is None or task.done():
            self._takeover = asyncio.ensure_future(self.take_over())

    async def on_revoked(self, app_, revoked, **kwargs) -> None:
        if self.scheduler_tp in revoked:
            self.holds = False
            await self.stop_owner("partition revoked")

    async def on_shutdown(self, app_, **kwargs) -> None:
        self.holds = False
        await self.stop_owner("shutting down")
        await asyncio.to_thread(self.follower.close)


def own_the_scheduler_partition(app: faust.App, settings: StreamsSettings, ownership: SchedulerOwnership) -> None:
    """Join the group on the scheduler topic, and follow Faust's assignment of its one partition."""
    scheduler_topic = app.topic(settings.scheduler_topic, key_type=bytes, value_type=bytes, partitions=1)
    app.on_partitions_assigned.connect(ownership.on_assigned)
    app.on_partitions_revoked.connect(ownership.on_revoked)
    app.on_before_shutdown.connect(ownership.on_shutdown)

    # concurrency=1 (Faust's default, pinned): nothing flows here, but an agent with more would
    # let Faust commit past messages not yet processed (faust-streaming issue 606).
    @app.agent(scheduler_topic, concurrency=1)
    async def scheduler_ownership(stream):
        async for _ in stream:  # nothing is sent here; the partition is what matters
            pass


def serve_metrics(app: faust.App, settings: StreamsSettings, metrics: metrics_mod.StreamsMetrics,
                  ownership: SchedulerOwnership) -> None:
    @app.task
    async def start_metrics() -> None:
        # The Faust worker sets the root logger to WARNING; our lifecycle lines are INFO.
        logging.getLogger("tokenmill.streams").setLevel(logging.INFO)
        metrics_mod.serve(settings.metrics_port)
        log.warning("started; joining the streams group")

    @app.timer(interval=0.25)
    async def refresh_metrics() -> None:
        owner = ownership.owner
        if owner is not None:
            try:
                metrics.observe_gate(owner.gate, metrics_mod.now(), force=True)
            except Exception:  # a metrics bug must never stop the scheduler (a Faust timer's error crashes the app)
                log.exception("refreshing the queue metrics failed")


def exit_when_stuck(app: faust.App, settings: StreamsSettings, ownership: SchedulerOwnership) -> None:
    watchdog = Watchdog(settings.recovery_timeout_s)

    @app.timer(interval=1.0)
    async def stuck_watchdog() -> None:
        owner = ownership.owner
        why = watchdog.verdict(Observation(
            now=time.monotonic(), rebalancing=bool(app.rebalancing), holds_scheduler=ownership.holds,
            owner_running=owner is not None, last_iteration_at=owner.last_iteration_at if owner else None))
        if why is not None:
            log.error("stuck: %s; exiting so that this instance starts afresh (or a standby takes over)", why)
            logging.shutdown()
            os._exit(RECOVERY_EXIT_CODE)


def create_app(app_id: str | None = None, settings: StreamsSettings | None = None) -> faust.App:
    settings = settings or StreamsSettings()
    if app_id is not None and app_id != settings.app_id:
        settings = StreamsSettings(app_id=app_id)
    ensure_topics(settings)
    app = faust_app(settings)
    metrics = metrics_mod.StreamsMetrics()
    metrics.set_active(False)
    follower = StateFollower(settings.state_topic, settings.topic_prefix + settings.app_id)
    ownership = SchedulerOwnership(settings, metrics, follower)
    own_the_scheduler_partition(app, settings, ownership)
    serve_metrics(app, settings, metrics, ownership)
    exit_when_stuck(app, settings, ownership)
    return app


def main(argv: list[str] | None = None) -> None:
    app = create_app()
    app.main()
