"""Admin changes made at the same moment never undo each other: a key revoked while others are
issued stays revoked (issue 21: 1 run in 3 brought a revoked key back)."""
from __future__ import annotations

import threading
import uuid

import pytest

from ingress.tenancy.tenant_admin import TenantAdmin
from ingress.tenancy.directory import TenantDirectory
from schemas import topics
from streams.reconcile import read_to_end
from ingress.tenancy.tenant_keys import covers, merge_keys

SECRET = b"race-test-secret"


def key(key_id, revoked=None):
    return {"key_id": key_id, "prefix": key_id[:4], "hash": "0" * 64, "created_ms": 1, "revoked_ms": revoked}


def test_merge_keeps_every_key_and_every_revocation_in_any_order():
    a = [key("k1"), key("k2", revoked=50)]
    b = [key("k1", revoked=70), key("k3")]
    for merged in (merge_keys(a, b), merge_keys(b, a)):
        by_id = {k["key_id"]: k["revoked_ms"] for k in merged}
        assert by_id == {"k1": 70, "k2": 50, "k3": None}
    assert covers(merge_keys(a, b), a) and covers(merge_keys(a, b), b)
    assert not covers(a, b) and not covers([key("k1")], [key("k1", revoked=5)])


def test_a_view_never_gives_back_a_revoked_key_or_drops_an_issued_one():
    directory = TenantDirectory()
    base = {"tenant_id": "t", "disabled": False}
    directory.apply("t", {**base, "api_keys": [key("k1", revoked=9), key("k2")]})
    directory.apply("t", {**base, "api_keys": [key("k1")]})  # written from a stale read
    by_id = {k["key_id"]: k["revoked_ms"] for k in directory.tenants["t"]["api_keys"]}
    assert by_id == {"k1": 9, "k2": None}


@pytest.mark.kafka
def test_keys_revoked_while_others_are_issued_all_stay_revoked(kafka_bootstrap):
    tenant_id = f"race-{uuid.uuid4().hex[:8]}"
    setup = TenantAdmin(SECRET)
    setup.upsert(tenant_id, name="race")
    old = [setup.issue_key(tenant_id) for _ in range(5)]
    new: list = []
    errors: list = []
    start = threading.Barrier(10)

    def revoke(issued):
        try:
            start.wait()
            TenantAdmin(SECRET).revoke_key(issued.key_id)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    def issue():
        try:
            start.wait()
            new.append(TenantAdmin(SECRET).issue_key(tenant_id))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=revoke, args=(k,)) for k in old] + [threading.Thread(target=issue)
                                                                           for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    # What compaction keeps is the tenant's last snapshot alone: it must hold every change.
    last = _last_snapshot(tenant_id)
    keys = {k["key_id"]: k["revoked_ms"] for k in last["api_keys"]}
    assert {k.key_id for k in old} | {k.key_id for k in new} == set(keys)
    assert all(keys[k.key_id] is not None for k in old)
    assert all(keys[k.key_id] is None for k in new)
    directory = TenantDirectory()
    directory.apply(tenant_id, last)
    assert all(directory.authenticate(k.key, SECRET) is None for k in old)
    assert all(directory.authenticate(k.key, SECRET) is not None for k in new)


def _last_snapshot(tenant_id: str) -> dict:
    last = None
    for key, record in read_to_end(topics.TENANTS.name, None, expect=("TenantSnapshot",)):
        if key == tenant_id.encode():
            last = record
    assert last is not None
    return last
