"""StoredLoginNonces: the uses of dashboard login links, in the billing store, shared by every billing
process and kept across restarts (migration 4, ``dashboard_logins``)."""
from __future__ import annotations

import time
import uuid

from billing_pipeline.store import Store


class StoredLoginNonces:
    def __init__(self, store: Store):
        self.store = store

    def first_use(self, nonce: str, expires: int) -> bool:
        """Record this use, then count the nonce's uses: True only when this one is the only one.
        Two processes redeeming one link at the same moment may both see two uses and both refuse;
        neither can see one use that is not its own, so a link never opens two sessions."""
        self.store.insert("dashboard_logins", [[nonce, int(expires), uuid.uuid4().hex, int(time.time() * 1000)]],
                          ["nonce", "expires_at", "redemption", "redeemed_at"])
        uses = self.store.scalar("SELECT count() FROM {db}.dashboard_logins WHERE nonce = {n:String}", {"n": nonce})
        return int(uses) == 1
