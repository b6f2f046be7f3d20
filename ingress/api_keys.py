"""API keys: random, shown once, stored only as a keyed hash plus a visible prefix.

A key looks like `tm-<key_id>-<secret>`. The key id finds the stored record; the
HMAC of the whole key under the deployment's secret is compared in constant time.
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


def key_hash(key: str, secret: bytes) -> str:
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()


def issue_key(secret: bytes) -> IssuedKey:
    key_id = secrets.token_hex(6)
    key = f"tm-{key_id}-{secrets.token_urlsafe(32)}"
    return IssuedKey(key=key, key_id=key_id, prefix=f"tm-{key_id}", hash=key_hash(key, secret))


def parse_key_id(key: str) -> str | None:
    parts = key.split("-", 2)
    if len(parts) != 3 or parts[0] != "tm" or len(parts[1]) != 12:
        return None
    return parts[1]


def verify(key: str, stored_hash: str, secret: bytes) -> bool:
    return hmac.compare_digest(key_hash(key, secret), stored_hash)
