"""Waiting for a private stack to be ready for a tenant's requests: a state the benchmark polls for, since
the stack's processes tell the benchmark nothing."""
from __future__ import annotations

import time


def wait_live(port: int, model: str, key: str, timeout: float = 60.0) -> None:
    """A new key works once ingress and streams have read the tenant snapshot."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
        if r.status_code == 200 and model in {m["id"] for m in r.json()["data"]}:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the benchmark tenant's key never worked: {r.status_code} {r.text[:200]}")
        time.sleep(0.3)
