"""API key hashes are bound to their tenant: a key record moved into another tenant's snapshot
does not authenticate there; keys hashed before the binding keep working where they are."""
from __future__ import annotations

from ingress.tenancy import api_keys
from ingress.tenancy.directory import TenantDirectory

SECRET = b"key-test-secret"


def snapshot(tenant_id, *keys):
    return {"tenant_id": tenant_id, "disabled": False, "api_keys": [
        {"key_id": k.key_id, "prefix": k.prefix, "hash": k.hash, "created_ms": 1, "revoked_ms": None} for k in keys]}


def test_a_key_authenticates_for_its_own_tenant_only():
    issued = api_keys.issue_key(SECRET, "acme")
    assert issued.hash.startswith("v2:")
    own = TenantDirectory()
    own.apply("acme", snapshot("acme", issued))
    assert own.authenticate(issued.key, SECRET).tenant_id == "acme"
    moved = TenantDirectory()  # whoever can write `tenants` copies the record under another tenant
    moved.apply("mallory", snapshot("mallory", issued))
    assert moved.authenticate(issued.key, SECRET) is None
    assert not api_keys.verify(issued.key, issued.hash, b"another-secret", "acme")


def test_keys_hashed_before_the_binding_still_work():
    legacy_key = "tm-0123456789ab-" + "s" * 43
    legacy = api_keys.IssuedKey(legacy_key, "0123456789ab", "tm-0123456789ab", api_keys.key_hash(legacy_key, SECRET))
    directory = TenantDirectory()
    directory.apply("old", snapshot("old", legacy))
    assert directory.authenticate(legacy_key, SECRET).tenant_id == "old"
    assert directory.authenticate(legacy_key[:-1] + "t", SECRET) is None
