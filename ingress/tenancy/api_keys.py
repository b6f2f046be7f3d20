"""API keys: random, shown once, stored only as a keyed hash plus a visible prefix.

A key looks like `tm-<key_id>-<secret>`. The key id finds the stored record; an HMAC under the
deployment's secret is compared in constant time. The HMAC covers the tenant id as well as the
whole key (and with it the key id), so a key record copied into another tenant's snapshot does not
verify there: moving a key needs the secret, not just write access to `tenants`. Hashes are
stored as ``v2:<hex>``; a bare hex hash is a key issued before tenants were bound in, which still
verifies the old way until it is re-issued (docs/security.md).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class IssuedKey:
    key: str        # shown to the operator once, never stored
    key_id: str
    prefix: str
    hash: str


BOUND = "v2:"


def key_hash(key: str, secret: bytes) -> str:
    """The hash of a key issued before tenant binding (kept so those keys keep working)."""
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()


def bound_hash(key: str, tenant_id: str, secret: bytes) -> str:
    message = b"\0".join((b"tokenmill-api-key/v2", tenant_id.encode(), key.encode()))
    return BOUND + hmac.new(secret, message, hashlib.sha256).hexdigest()


def issue_key(secret: bytes, tenant_id: str) -> IssuedKey:
    key_id = secrets.token_hex(6)
    key = f"tm-{key_id}-{secrets.token_urlsafe(32)}"
    return IssuedKey(key=key, key_id=key_id, prefix=f"tm-{key_id}", hash=bound_hash(key, tenant_id, secret))


def parse_key_id(key: str) -> str | None:
    parts = key.split("-", 2)
    if len(parts) != 3 or parts[0] != "tm" or len(parts[1]) != 12:
        return None
    return parts[1]


def verify(key: str, stored_hash: str, secret: bytes, tenant_id: str = "") -> bool:
    """Whether `key` is the key stored as `stored_hash` for `tenant_id`."""
    expected = bound_hash(key, tenant_id, secret) if stored_hash.startswith(BOUND) else key_hash(key, secret)
    return hmac.compare_digest(expected.encode(), stored_hash.encode())
