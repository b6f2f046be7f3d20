"""Every process's materialized view of the compacted `tenants` topic."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from infra.kafka.compacted_view import CompactedFollower
from ingress.tenancy import api_keys
from ingress.tenancy.tenant_keys import merge_keys
from schemas import checks, topics

log = logging.getLogger(__name__)


@dataclass
class Caller:
    tenant: dict[str, Any]
    key_id: str

    @property
    def tenant_id(self) -> str:
        return self.tenant["tenant_id"]


@dataclass
class TenantDirectory:
    """Pure state: tenant snapshots by id, applied in topic order."""
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    _keys: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)  # key_id -> (tenant_id, key record)

    def apply(self, tenant_id: str, snapshot: dict[str, Any] | None) -> None:
        old = self.tenants.pop(tenant_id, None)
        if old:
            for key in old["api_keys"]:
                self._keys.pop(key["key_id"], None)
        if snapshot is None:  # tombstone: tenant deleted
            return
        if old:
            # A snapshot written from a stale read may lack a key or a revocation made meanwhile;
            # keys only accumulate and get revoked, so nothing a view has seen is given back
            # (its writer re-publishes the merge, ingress/tenancy/tenant_admin.py).
            snapshot = {**snapshot, "api_keys": merge_keys(snapshot["api_keys"], old["api_keys"])}
        self.tenants[tenant_id] = snapshot
        for key in snapshot["api_keys"]:
            self._keys[key["key_id"]] = (tenant_id, key)

    def authenticate(self, presented: str | None, secret: bytes) -> Caller | None:
        """The caller for a presented key, or None for a missing, unknown, revoked or disabled one."""
        if not presented:
            return None
        key_id = api_keys.parse_key_id(presented)
        found = self._keys.get(key_id) if key_id else None
        if not key_id or found is None:
            # Still spend a hash so unknown and wrong keys take the same time.
            api_keys.verify(presented, "0" * 64, secret)
            return None
        tenant_id, record = found
        if not api_keys.verify(presented, record["hash"], secret, tenant_id):
            return None
        tenant = self.tenants.get(tenant_id)
        if record.get("revoked_ms") is not None or tenant is None or tenant["disabled"]:
            return None
        return Caller(tenant=tenant, key_id=key_id)


class TenantFollower:
    """Keeps a TenantDirectory current by reading `tenants` from the beginning, forever (`start`), or once
    up to its end (`catch_up`)."""

    def __init__(self, directory: TenantDirectory | None = None, client_id: str = "tenant-follower",
                 dead_letters: bool = False):
        self.directory = directory or TenantDirectory()
        self._client_id = client_id
        # A serving process parks what it cannot apply on `dead-letters`; a one-shot reader (the
        # admin CLI) only logs it.
        self.dead_letters = kafka_clients.DeadLetters(client_id if dead_letters else None)
        self._follower = CompactedFollower(topics.TENANTS.name, client_id, self._handle, dead_letters=self.dead_letters)

    def _partitions_and_ends(self) -> dict[int, int]:
        """Each `tenants` partition and its end offset now."""
        return kafka_clients.with_retries(lambda: topic_reader.end_offsets(topics.TENANTS.name, self._client_id),
                                          "reading `tenants` metadata")

    def _handle(self, msg) -> None:
        try:
            tenant_id = msg.key().decode() if msg.key() else None
        except UnicodeDecodeError as exc:
            self.dead_letters.unprocessable(msg, exc)
            return
        if tenant_id is None:
            return
        if msg.value() is None:
            self.directory.apply(tenant_id, None)
            return
        event = self.dead_letters.decode(msg, ("TenantSnapshot",))
        if event is None:
            return  # the tenant keeps its last good snapshot
        problem = checks.tenant_key_problem(event.record, tenant_id)
        if problem:
            self.dead_letters.send(msg, problem)
            return
        try:
            self.directory.apply(tenant_id, event.record)
        except Exception as exc:  # never let one record stop the view
            self.dead_letters.unprocessable(msg, exc)

    def catch_up(self, timeout: float = 15.0) -> TenantDirectory:
        """Read up to the current end of the topic once (for the CLI and admin changes). Raises
        TimeoutError rather than return a partial view: a change written from one would drop
        whatever it had not read yet."""
        ends = self._partitions_and_ends()
        self.ends = dict(ends)
        name = topics.TENANTS.name
        for msg in topic_reader.read_to_end({(name, p): OFFSET_BEGINNING for p in ends}, self._client_id, timeout,
                                            ends={(name, p): end for p, end in ends.items()}):
            self._handle(msg)
        return self.directory

    def start(self, wait: float = 15.0) -> None:
        """Follow the topic; returns once the directory holds what the topic held (or after `wait`)."""
        self._follower.start()
        self._follower.wait_caught_up(wait)

    def stop(self) -> None:
        self._follower.stop()
