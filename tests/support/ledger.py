"""Reading the ledger of a running stack, as the billing admin API answers it."""
from __future__ import annotations

import time

import httpx

from tests.integration.conftest import ADMIN_TOKEN


def ledger_rows(billing_url: str, request_ids, timeout: float = 30.0, admin_token: str = ADMIN_TOKEN) -> list[dict]:
    """The ledger rows of `request_ids`, once each of them has one. At the timeout, what there is: the
    caller's assertions then say which are missing (or billed twice)."""
    wanted = set(request_ids)
    deadline = time.monotonic() + timeout
    while True:
        answer = httpx.post(f"{billing_url}/admin/ledger/lookup", json={"request_ids": sorted(wanted)},
                            headers={"Authorization": f"Bearer {admin_token}"}, timeout=30)
        answer.raise_for_status()
        rows = answer.json()
        if {row["request_id"] for row in rows} >= wanted or time.monotonic() > deadline:
            return rows
        time.sleep(0.3)
