"""The settings object the streams process builds at start, from the registry (infra/settings.py).

Everything has a default that suits one local stack; tests override a few (a topic
prefix so a test's streams process has topics of its own, shorter liveness windows).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from schedulers import TokenWeights
from schedulers.placement import PlacementPolicy
from infra import settings
from infra.config import token_weights_from_env
from schemas import topics

# The recovery watchdog's exit status: "give the scheduler partition up and start afresh".
# `tokenmill serve streams` starts the worker again when it exits with it (tokenmill.stack.processes.supervise).
RECOVERY_EXIT_CODE = 3


@dataclass(frozen=True)
class StreamsSettings:
    # Prepended to every topic name (public and internal). Empty in a real deployment;
    # lets several tokenmill installations, or tests, share one Kafka cluster.
    topic_prefix: str = field(default_factory=settings.TOPIC_PREFIX.get)
    app_id: str = field(default_factory=settings.STREAMS_APP_ID.get)
    # How often the owner asks billing for each tenant's month-to-date tokens (monthly budgets).
    budget_poll_s: float = field(default_factory=settings.BUDGET_POLL_S.get)
    # Log every gate decision (debugging).
    trace: bool = field(default_factory=settings.STREAMS_TRACE.get)
    # Prometheus endpoint; 0 turns it off.
    metrics_port: int = field(default_factory=settings.STREAMS_METRICS_PORT.get)
    # An instance stuck this long (in a rebalance, holding the scheduler without running it, or
    # with a loop that stopped completing iterations) exits to be restarted (streams/watchdog.py).
    recovery_timeout_s: float = field(default_factory=settings.STREAMS_RECOVERY_TIMEOUT_S.get)
    # A worker advert older than this (by its own timestamp) no longer grants credits.
    advert_ttl_s: float = field(default_factory=settings.STREAMS_ADVERT_TTL_S.get)
    # A released request not yet seen taken in by any worker stops holding a credit
    # after this long (it landed on a busy worker's partition, or its taker died).
    in_transit_ttl_s: float = field(default_factory=settings.STREAMS_IN_TRANSIT_TTL_S.get)
    # How often queued requests past their deadline are shed.
    shed_interval_s: float = field(default_factory=settings.STREAMS_SHED_INTERVAL_S.get)
    # QuotaState for one tenant is published at most this often.
    quota_publish_interval_s: float = field(
        default_factory=settings.STREAMS_QUOTA_PUBLISH_S.get)
    # retry_after_s in a deadline shed.
    shed_retry_after_s: float = 1.0
    # A batch request competes as interactive after waiting this long.
    batch_aging_s: float = field(default_factory=settings.STREAMS_BATCH_AGING_S.get)
    # Ended request ids are remembered this long so a redelivered request is ignored.
    ended_ttl_s: float = 600.0
    # Faust group liveness: how fast a standby notices that the active instance died.
    session_timeout_s: float = field(default_factory=settings.STREAMS_SESSION_TIMEOUT_S.get)
    token_weights: TokenWeights = field(default_factory=token_weights_from_env)
    # Preempt running sequences for a tenant (or interactive request) owed a slot while the
    # pool is full (schedulers/preemption.py). 0 turns it off: slots then move only as
    # sequences end.
    preemption: bool = field(default_factory=settings.STREAMS_PREEMPTION.get)
    # A tenant that lost a slot to another cannot take one back from it for this long.
    preempt_hysteresis_s: float = field(default_factory=settings.STREAMS_PREEMPT_HYSTERESIS_S.get)

    # Where a released request runs when its model has more than one worker (schedulers/placement.py):
    # prefix-aware (default) or least-loaded (cache-blind).
    placement: PlacementPolicy = field(default_factory=lambda: PlacementPolicy(settings.STREAMS_PLACEMENT.get()))

    def topic(self, spec_or_name) -> str:
        name = spec_or_name if isinstance(spec_or_name, str) else spec_or_name.name
        return self.topic_prefix + name

    @property
    def scheduler_topic(self) -> str:
        """Internal, one partition: whoever holds it as active owns the queue."""
        return self.topic_prefix + self.app_id + "-scheduler"

    @property
    def transactional_id(self) -> str:
        """The owner's Kafka transactional id, the same on every instance: whoever takes it over
        fences the previous holder (owner_transaction.py)."""
        return self.topic_prefix + self.app_id + "-owner"

    @property
    def state_topic(self) -> str:
        """Internal, compacted, one partition: the gate's durable state (state_store.py). It keeps
        the name it had as a Faust table changelog, so existing state carries over."""
        return self.topic_prefix + self.app_id + "-state-changelog"

    # topic name -> what it carries
    def input_topics(self) -> dict[str, str]:
        return {
            self.topic(topics.REQUESTS): "requests",
            self.topic(topics.USAGE): "usage",
            self.topic(topics.CANCELLATIONS): "cancellations",
            self.topic(topics.CAPACITY): "capacity",
            self.topic(topics.TENANTS): "tenants",
        }
