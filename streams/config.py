"""Settings of the streams process, read from the environment.

Everything has a default that suits one local stack; tests override a few (a topic
prefix so a test's streams process has topics of its own, shorter liveness windows).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from schedulers import TokenWeights
from schedulers.placement import PlacementPolicy
from infra.config import token_weights_from_env
from schemas import topics

# The recovery watchdog's exit status: "give the scheduler partition up and start afresh".
# `tokenmill serve streams` starts the worker again when it exits with it (tokenmill.stack.processes.supervise).
RECOVERY_EXIT_CODE = 3


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw not in (None, "") else default


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw not in (None, "") else default




@dataclass(frozen=True)
class StreamsSettings:
    # Prepended to every topic name (public and internal). Empty in a real deployment;
    # lets several tokenmill installations, or tests, share one Kafka cluster.
    topic_prefix: str = field(default_factory=lambda: os.environ.get("TOKENMILL_TOPIC_PREFIX", ""))
    app_id: str = field(default_factory=lambda: os.environ.get("TOKENMILL_STREAMS_APP_ID", "tokenmill-streams"))
    # How often the owner asks billing for each tenant's month-to-date tokens (monthly budgets).
    budget_poll_s: float = field(default_factory=lambda: _float("TOKENMILL_BUDGET_POLL_S", 30.0))
    # Log every gate decision (debugging).
    trace: bool = field(default_factory=lambda: os.environ.get("TOKENMILL_STREAMS_TRACE") == "1")
    # Prometheus endpoint; 0 turns it off.
    metrics_port: int = field(default_factory=lambda: _int("TOKENMILL_STREAMS_METRICS_PORT", 9102))
    # An instance stuck this long (in a rebalance, holding the scheduler without running it, or
    # with a loop that stopped completing iterations) exits to be restarted (streams/watchdog.py).
    recovery_timeout_s: float = field(default_factory=lambda: _float("TOKENMILL_STREAMS_RECOVERY_TIMEOUT_S", 30.0))
    # A worker advert older than this (by its own timestamp) no longer grants credits.
    advert_ttl_s: float = field(default_factory=lambda: _float("TOKENMILL_STREAMS_ADVERT_TTL_S", 5.0))
    # A released request not yet seen taken in by any worker stops holding a credit
    # after this long (it landed on a busy worker's partition, or its taker died).
    in_transit_ttl_s: float = field(default_factory=lambda: _float("TOKENMILL_STREAMS_IN_TRANSIT_TTL_S", 3.0))
    # How often queued requests past their deadline are shed.
    shed_interval_s: float = field(default_factory=lambda: _float("TOKENMILL_STREAMS_SHED_INTERVAL_S", 0.05))
    # QuotaState for one tenant is published at most this often.
    quota_publish_interval_s: float = field(
        default_factory=lambda: _float("TOKENMILL_STREAMS_QUOTA_PUBLISH_S", 0.2))
    # retry_after_s in a deadline shed.
    shed_retry_after_s: float = 1.0
    # A batch request competes as interactive after waiting this long.
    batch_aging_s: float = field(default_factory=lambda: _float("TOKENMILL_STREAMS_BATCH_AGING_S", 30.0))
    # Ended request ids are remembered this long so a redelivered request is ignored.
    ended_ttl_s: float = 600.0
    # Faust group liveness: how fast a standby notices that the active instance died.
    session_timeout_s: float = field(default_factory=lambda: _float("TOKENMILL_STREAMS_SESSION_TIMEOUT_S", 6.0))
    token_weights: TokenWeights = field(default_factory=token_weights_from_env)
    # Preempt running sequences for a tenant (or interactive request) owed a slot while the
    # pool is full (schedulers/preemption.py). 0 turns it off: slots then move only as
    # sequences end.
    preemption: bool = field(default_factory=lambda: os.environ.get("TOKENMILL_STREAMS_PREEMPTION", "1") != "0")
    # A tenant that lost a slot to another cannot take one back from it for this long.
    preempt_hysteresis_s: float = field(default_factory=lambda: _float("TOKENMILL_STREAMS_PREEMPT_HYSTERESIS_S",
                                                                       10.0))

    # Where a released request runs when its model has more than one worker (schedulers/placement.py):
    # prefix-aware (default) or least-loaded (cache-blind).
    placement: PlacementPolicy = field(default_factory=lambda: PlacementPolicy(
        os.environ.get("TOKENMILL_STREAMS_PLACEMENT") or PlacementPolicy.PREFIX_AWARE.value))

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
