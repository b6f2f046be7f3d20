"""Adapter uploads off the serving path (issue 56): an upload of 64 MiB must not stall other tenants' streams.

Admin and public listeners share one event loop, and the heavy parts of an upload hold the interpreter
while they run: parsing ~85 MB of JSON, checking it for lone surrogates, decoding the base64 and reading
every weight (about 0.5 s of CPU for the largest adapter). A thread would not help (json.loads keeps the
GIL), so they run in one process of their own at the lowest CPU priority, one upload at a time; the event
loop only receives the body and hands it over. What needs the catalog (the name is free, the tenant's
quotas) and the publish to Kafka then run on a thread of their own, never on the pool that tokenizes every
tenant's prompts. At most MAX_CONCURRENT_UPLOADS are taken at once; one more is a 429 before its body is read.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from http_api.openai_errors import APIError
from ingress.tenancy.adapter_registry import AdapterRegistry, prepare_registration

MAX_CONCURRENT_UPLOADS = 8


def _lowest_priority() -> None:
    os.nice(19)


class UploadPool:
    def __init__(self, max_concurrent: int = MAX_CONCURRENT_UPLOADS) -> None:
        self.max_concurrent = max_concurrent
        self.in_flight = 0
        self._checker: ProcessPoolExecutor | None = None
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-publish")

    def admit(self) -> None:
        """Take a place for one upload, or the 429 that says none is free (call `release` when it ends)."""
        if self.in_flight >= self.max_concurrent:
            raise APIError(429, f"{self.in_flight} adapter uploads are in progress, the most at once; retry when "
                                f"one has ended.", code="too_many_uploads", headers={"Retry-After": "5"})
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def _process(self) -> ProcessPoolExecutor:
        if self._checker is None:
            self._checker = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_lowest_priority)
        return self._checker

    async def prepare(self, raw: bytes, tenant_id: str, registry: AdapterRegistry) -> tuple[Any, tuple]:
        """The Registration and check_files' answer of an upload body, read in the checking process; the
        APIError that refuses it otherwise."""
        loop = asyncio.get_running_loop()
        try:
            outcome, value = await loop.run_in_executor(
                self._process(), prepare_registration, raw, tenant_id, registry.models, registry.max_rank,
                registry.max_bytes)
        except BrokenProcessPool:  # the checker died (killed, out of memory): the next upload gets a new one
            self._checker = None
            raise APIError(503, "The adapter checker stopped; retry.", code="service_unavailable",
                           headers={"Retry-After": "1"}) from None
        if outcome == "refused":
            status, message, code, param = value
            raise APIError(status, message, code=code, param=param)
        return value

    async def run(self, fn, *args):
        """`fn(*args)` on the upload thread (catalog checks and the publish)."""
        return await asyncio.get_running_loop().run_in_executor(self._publisher, fn, *args)

    def close(self) -> None:
        if self._checker is not None:
            self._checker.shutdown(wait=False, cancel_futures=True)
        self._publisher.shutdown(wait=False, cancel_futures=True)
