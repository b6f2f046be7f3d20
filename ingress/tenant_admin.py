"""Operator actions on tenants and API keys, published as snapshots on `tenants`."""
from __future__ import annotations

import time
from typing import Any

from confluent_kafka import Producer

from infra import kafka_clients
from ingress import api_keys
from ingress.tenant_directory import TenantFollower
from schemas import codec, topics

TENANT_FIELDS = (
    "name", "plan", "requests_per_minute", "tokens_per_minute", "max_concurrent", "monthly_token_budget",
    "allowed_models", "allowed_priorities", "fairness_weight", "default_deadline_s", "max_queued",
    "share_prefix_cache", "disabled",
)


class TenantAdmin:
    def __init__(self, secret: bytes):
        self.secret = secret
        self.producer = Producer(kafka_clients.producer_config("tenant-admin"))

    def _current(self, tenant_id: str) -> dict[str, Any] | None:
        return TenantFollower(client_id="tenant-admin").catch_up().tenants.get(tenant_id)

    def list(self) -> list[dict[str, Any]]:
        return list(TenantFollower(client_id="tenant-admin").catch_up().tenants.values())

    def _publish(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        record = codec.new_event("TenantSnapshot", **{k: v for k, v in snapshot.items()
                                                    if k not in ("event_id", "timestamp_ms", "schema_version", "request_id")})
        kafka_clients.produce_event(self.producer, topics.TENANTS.name, record["tenant_id"], "TenantSnapshot", record)
        if self.producer.flush(15) != 0:
            raise RuntimeError("tenant update was not acknowledged by Kafka")
        return record

    def upsert(self, tenant_id: str, **changes: Any) -> dict[str, Any]:
        unknown = set(changes) - set(TENANT_FIELDS)
        if unknown:
            raise ValueError(f"unknown tenant fields: {sorted(unknown)}")
        current = self._current(tenant_id)
        if current is None:
            # Fill the defaults from the schema itself, so there is one source of truth.
            defaults = codec.decode(*codec.encode("TenantSnapshot", codec.new_event(
                "TenantSnapshot", tenant_id=tenant_id))).record
            current = defaults
        current.update({k: v for k, v in changes.items() if v is not None})
        try:  # refuse wrongly typed values here, with a message, not deep in the producer
            codec.encode("TenantSnapshot", codec.new_event("TenantSnapshot", **{
                k: v for k, v in current.items() if k not in ("event_id", "timestamp_ms", "schema_version", "request_id")}))
        except Exception as exc:
            raise ValueError(f"invalid tenant settings: {exc}") from None
        return self._publish(current)

    def issue_key(self, tenant_id: str) -> api_keys.IssuedKey:
        current = self._current(tenant_id)
        if current is None:
            raise KeyError(f"no tenant {tenant_id!r}")
        issued = api_keys.issue_key(self.secret)
        current["api_keys"].append({"key_id": issued.key_id, "prefix": issued.prefix, "hash": issued.hash,
                                    "created_ms": int(time.time() * 1000), "revoked_ms": None})
        self._publish(current)
        return issued

    def revoke_key(self, key_id_or_prefix: str) -> str:
        key_id = key_id_or_prefix.removeprefix("tm-")
        for tenant in self.list():
            for key in tenant["api_keys"]:
                if key["key_id"] == key_id and key["revoked_ms"] is None:
                    key["revoked_ms"] = int(time.time() * 1000)
                    self._publish(tenant)
                    return tenant["tenant_id"]
        raise KeyError(f"no active key {key_id_or_prefix!r}")
