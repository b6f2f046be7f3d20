"""Operator actions on tenants and API keys, published as snapshots on `tenants`.

Every change is a read-modify-write of the tenant's whole snapshot, and two admins (or an admin
and the CLI) may change one tenant at the same moment. Keys are merged rather than overwritten
(ingress/tenancy/tenant_keys.py): after publishing, a change reads back the tenant's partition from where
its own read ended up to its own record; if another change landed in between with a key or a
revocation this one lacks, it publishes the merge, and checks again. So the last snapshot of a
tenant always holds every key ever issued and every revocation ever made, whichever order the
writes landed in (a snapshot written from a stale read is always followed by its writer's
correction, and the final writer has read everything after its own read).
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable

from confluent_kafka import Producer

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from ingress.tenancy import api_keys
from ingress.tenancy.directory import TenantFollower
from ingress.tenancy.tenant_keys import covers, merge_keys
from schemas import checks, codec, topics

MAX_MERGE_ROUNDS = 20
ENVELOPE = ("event_id", "timestamp_ms", "schema_version", "request_id")

TENANT_FIELDS = (
    "name", "plan", "requests_per_minute", "tokens_per_minute", "max_concurrent", "monthly_token_budget",
    "allowed_models", "allowed_priorities", "fairness_weight", "default_deadline_s", "max_queued",
    "share_prefix_cache", "disabled",
)


class InvalidTenantId(ValueError):
    """A tenant id that breaks `schemas.checks.TENANT_ID_PATTERN`; refused before anything is read or written."""


def require_valid_tenant_id(tenant_id: object) -> None:
    problem = checks.tenant_id_problem(tenant_id)
    if problem:
        raise InvalidTenantId(problem)


class TenantAdmin:
    def __init__(self, secret: bytes):
        self.secret = secret
        self.producer = Producer(kafka_clients.producer_config("tenant-admin"))

    def tenants(self) -> list[dict[str, Any]]:
        """Every tenant's snapshot, as `tenants` holds them now."""
        return list(TenantFollower(client_id="tenant-admin").catch_up().tenants.values())

    def _publish(self, snapshot: dict[str, Any]) -> tuple[dict[str, Any], int, int]:
        """Write a snapshot; returns the record and where it landed (partition, offset)."""
        record = codec.new_event("TenantSnapshot", **{k: v for k, v in snapshot.items() if k not in ENVELOPE})
        landed: list[tuple[int, int]] = []

        def on_delivery(err, msg):
            if err is None:
                landed.append((msg.partition(), msg.offset()))

        kafka_clients.produce_event(self.producer, topics.TENANTS.name, record["tenant_id"], "TenantSnapshot", record,
                                    on_delivery=on_delivery)
        if self.producer.flush(15) != 0 or not landed:
            raise RuntimeError("tenant update was not acknowledged by Kafka")
        return record, *landed[0]

    def _snapshots_between(self, tenant_id: str, partition: int, start: int, end: int) -> list[dict[str, Any]]:
        """This tenant's snapshots at offsets [start, end) of its partition (what others wrote meanwhile)."""
        if start >= end:
            return []
        found: list[dict[str, Any]] = []
        key = (topics.TENANTS.name, partition)
        for msg in topic_reader.read_to_end({key: start}, "tenant-admin-check", 15, ends={key: end}):
            if msg.key() == tenant_id.encode() and msg.value() is not None:
                try:
                    found.append(codec.decode(msg.value(), msg.headers(), expect=("TenantSnapshot",)).record)
                except codec.UndecodableEvent:
                    continue  # parked by the readers; it carries nothing to merge
        return found

    def _change(self, tenant_id: str, change: Callable[[dict[str, Any]], None], create: bool = False) -> dict[str, Any]:
        # Every change goes through here: no snapshot with a bad id is ever published (readers would park it).
        require_valid_tenant_id(tenant_id)
        follower = TenantFollower(client_id="tenant-admin")
        current = follower.catch_up().tenants.get(tenant_id)
        if current is None:
            if not create:
                raise KeyError(f"no tenant {tenant_id!r}")
            # Fill the defaults from the schema itself, so there is one source of truth.
            current = codec.decode(*codec.encode("TenantSnapshot", codec.new_event(
                "TenantSnapshot", tenant_id=tenant_id))).record
        snapshot = copy.deepcopy(current)
        change(snapshot)
        try:  # refuse wrongly typed values here, with a message, not deep in the producer
            codec.encode("TenantSnapshot", codec.new_event("TenantSnapshot", **{
                k: v for k, v in snapshot.items() if k not in ENVELOPE}))
        except Exception as exc:
            raise ValueError(f"invalid tenant settings: {exc}") from None
        record, partition, offset = self._publish(snapshot)
        start = follower.ends.get(partition, 0)
        for _ in range(MAX_MERGE_ROUNDS):
            others = self._snapshots_between(tenant_id, partition, start, offset)
            if all(covers(record["api_keys"], other["api_keys"]) for other in others):
                return record
            merged = dict(record, api_keys=merge_keys(record["api_keys"], *(o["api_keys"] for o in others)))
            start = offset + 1
            record, partition, offset = self._publish(merged)
        raise RuntimeError(f"tenant {tenant_id!r} kept changing; its keys may need a check (tokenmill keys list)")

    def upsert(self, tenant_id: str, **changes: Any) -> dict[str, Any]:
        unknown = set(changes) - set(TENANT_FIELDS)
        if unknown:
            raise ValueError(f"unknown tenant fields: {sorted(unknown)}")
        return self._change(tenant_id, lambda s: s.update({k: v for k, v in changes.items() if v is not None}),
                            create=True)

    def issue_key(self, tenant_id: str) -> api_keys.IssuedKey:
        issued = api_keys.issue_key(self.secret, tenant_id)
        self._change(tenant_id, lambda s: s["api_keys"].append({
            "key_id": issued.key_id, "prefix": issued.prefix, "hash": issued.hash,
            "created_ms": int(time.time() * 1000), "revoked_ms": None}))
        return issued

    def revoke_key(self, key_id_or_prefix: str) -> str:
        key_id = key_id_or_prefix.removeprefix("tm-")
        for tenant in self.tenants():
            if any(k["key_id"] == key_id and k["revoked_ms"] is None for k in tenant["api_keys"]):
                def revoke(snapshot: dict[str, Any]) -> None:
                    for key in snapshot["api_keys"]:
                        if key["key_id"] == key_id and key["revoked_ms"] is None:
                            key["revoked_ms"] = int(time.time() * 1000)
                self._change(tenant["tenant_id"], revoke)
                return tenant["tenant_id"]
        raise KeyError(f"no active key {key_id_or_prefix!r}")
