"""Waiting for a state to be reached, never for a time to pass."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

import httpx

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 20.0, what: str = "the condition",
               every: float = 0.05) -> T:
    """Ask `predicate` until it answers something truthy, and return that; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        answer = predicate()
        if answer:
            return answer
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not reached within {timeout:.0f} s")
        time.sleep(every)


def key_accepted(base_url: str, key: str) -> bool:
    return httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def wait_key_accepted(base_url: str, key: str, timeout: float = 20.0) -> None:
    """An ingress learns a new key from `tenants` a moment after it was issued: wait until the one at
    `base_url` accepts it."""
    wait_until(lambda: key_accepted(base_url, key), timeout, f"ingress at {base_url} accepting a new key")
