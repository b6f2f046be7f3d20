"""API keys only ever accumulate and get revoked: the merge that keeps concurrent admin writes
from undoing each other.

`tenants` holds one whole snapshot per tenant, so every admin change is a read-modify-write.
Two changes made at once (a key revoked while another is issued) both read the same snapshot,
and the later write would drop the earlier one's change, bringing a revoked key back. Keys,
though, are monotonic: a key, once issued, is never removed, and once revoked never becomes
valid again. So snapshots can be merged without knowing their order: the union of keys, each
revoked if any snapshot says so (at the earliest time any says).
"""
from __future__ import annotations

from typing import Any


def merge_keys(*key_lists: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Union by key id, in first-seen order; a key is revoked if it is revoked in any list."""
    merged: dict[str, dict[str, Any]] = {}
    for keys in key_lists:
        for key in keys:
            known = merged.get(key["key_id"])
            if known is None:
                merged[key["key_id"]] = dict(key)
            elif key.get("revoked_ms") is not None:
                revoked = [t for t in (known.get("revoked_ms"), key["revoked_ms"]) if t is not None]
                known["revoked_ms"] = min(revoked)
    return list(merged.values())


def covers(keys: list[dict[str, Any]], others: list[dict[str, Any]]) -> bool:
    """Whether `keys` already holds every fact of `others` (no key missing, no revocation missing)."""
    by_id = {k["key_id"]: k for k in keys}
    for key in others:
        mine = by_id.get(key["key_id"])
        if mine is None or (key.get("revoked_ms") is not None and mine.get("revoked_ms") is None):
            return False
    return True
