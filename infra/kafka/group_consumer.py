"""A consumer-group member that heals itself: the one lifecycle every service with a group client
shares (the GPU workers on `work`, the ledger writer on `usage`).

librdkafka's group client can stay without a coordinator after a broker restart (librdkafka issues
2944, 3082, 3396; seen here: "Waiting for coordinator" for minutes after the broker was back), and
can leave an assigned partition unfetched for good (infra/kafka/fetch_watch.py). Either way the service
falls behind its topic while it looks healthy. The remedy for both is the same: a fresh client,
the old one closed in the background (its close() can block for good) and its callbacks ignored
from then on. The owner's callbacks only ever see the current client.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from confluent_kafka import Consumer

from infra.kafka import clients as kafka_clients
from infra.kafka.consume import close_in_background
from infra.kafka.fetch_watch import CHECK_EVERY_S, STALL_AFTER_S, FetchWatch, group_positions

log = logging.getLogger(__name__)

Rebalance = Callable[[Consumer, list], None]


@dataclass(frozen=True)
class Healing:
    """When a member counts as stuck."""
    rejoin_after_s: float  # without any partition this long (after it lost them all, or never got one)
    stall_after_s: float  # a partition with records beyond the position that does not move this long
    check_every_s: float  # how often the broker is asked for partition ends


# On the token path a stall is a client waiting for its first token: replace early (a static member
# gets its partitions straight back, so a needless rejoin costs little).
TOKEN_PATH = Healing(rejoin_after_s=4.0, stall_after_s=STALL_AFTER_S, check_every_s=CHECK_EVERY_S)
# Off it (the ledger), and a batch insert can hold the client for a while: longer bounds.
OFF_TOKEN_PATH = Healing(rejoin_after_s=8.0, stall_after_s=6.0, check_every_s=2.0)


class HealingGroupConsumer:
    """One group member on one topic. Call ``heal()`` from the loop that polls ``client``."""

    def __init__(self, topic: str, make_client: Callable[[], Consumer], what: str, healing: Healing, *,
                 on_assign: Rebalance | None = None, on_revoke: Rebalance | None = None,
                 on_lost: Rebalance | None = None, rejoin_if_never_assigned: bool = True,
                 fetch_watch: FetchWatch | None = None):
        self.topic = topic
        self.what = what
        self.healing = healing
        self._make_client = make_client
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._on_lost = on_lost or on_revoke
        # A member that may legitimately stay without partitions (more members than partitions) must
        # not count that as stuck until it has had some.
        self._rejoin_if_never_assigned = rejoin_if_never_assigned
        self._unassigned_since: float | None = None
        self._fetch_watch = fetch_watch or FetchWatch(kafka_clients.bootstrap_servers(),
                                                      stall_after_s=healing.stall_after_s,
                                                      check_every_s=healing.check_every_s)
        self.client: Consumer = make_client()
        self.replacements = 0

    # --- membership -----------------------------------------------------------------------
    def subscribe(self) -> None:
        self._unassigned_since = time.monotonic() if self._rejoin_if_never_assigned else None
        self.client.subscribe([self.topic], on_assign=self._assigned, on_revoke=self._revoked,
                              on_lost=self._lost)

    def _assigned(self, client: Consumer, partitions: list) -> None:
        if client is not self.client:
            return  # a replaced client closing
        if self._on_assign is not None:
            self._on_assign(client, partitions)
        self._unassigned_since = None

    def _revoked(self, client: Consumer, partitions: list) -> None:
        self._gone(client, partitions, self._on_revoke)

    def _lost(self, client: Consumer, partitions: list) -> None:
        self._gone(client, partitions, self._on_lost)

    def _gone(self, client: Consumer, partitions: list, callback: Rebalance | None) -> None:
        if client is not self.client:
            return
        if callback is not None:
            callback(client, partitions)
        # During an incremental revoke the assignment still lists the partitions being taken.
        left = {p.partition for p in client.assignment()} - {p.partition for p in partitions}
        if not left:
            self._unassigned_since = time.monotonic()

    # --- healing ------------------------------------------------------------------------------
    def heal(self, expect_fetching: bool = True) -> bool:
        """Replace the client if it is stuck; True if it was. ``expect_fetching`` False says the owner
        fetches nothing on purpose (a full engine), so unmoving positions mean nothing now."""
        since = self._unassigned_since
        if since is not None and time.monotonic() - since >= self.healing.rejoin_after_s:
            log.warning("%s: no partitions of `%s` for %.0f s; starting a fresh consumer", self.what, self.topic,
                        time.monotonic() - since)
            self.replace()
            return True
        if not expect_fetching or since is not None:
            self._fetch_watch.reset()
            return False
        if not self._fetch_watch.due():
            return False
        try:
            positions = group_positions(self.client)
        except Exception as exc:  # the broker is away: nothing to judge by now
            log.debug("%s: positions unavailable: %s", self.what, exc)
            return False
        stuck = self._fetch_watch.stalled(positions)
        if stuck:
            log.warning("%s: partitions %s have records but are not fetched; starting a fresh consumer",
                        self.what, [p for _, p in stuck])
            self.replace()
            return True
        return False

    def replace(self) -> None:
        old, self.client = self.client, self._make_client()
        close_in_background(old, self.what)
        self.replacements += 1
        self._fetch_watch.reset()
        # A static member (the workers) gets its partitions straight back, so the rejoin bound runs
        # again from now. A dynamic one (the ledger writer) may wait out the old member's session in a
        # rebalance first; counting that as stuck would replace it again and again, each fresh client
        # re-reading (and dead-lettering again) what was not yet committed.
        self.subscribe()

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # already closed
            pass
        self._fetch_watch.close()
