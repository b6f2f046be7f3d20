"""A worker's tenants' LoRA adapters: its view of the `adapters` topic (manifests and chunks,
infra/adapters.py) and the local directory each one is written to the first time a request needs it,
in PEFT's layout, which the engine loads (gpu_consumers/engine: LoraRequest(adapter_id, path)).

A request names its adapter's id and version (InferenceRequested.adapter). The files of that version
are served even if the adapter was deleted after a request was admitted, as long as this worker still
has them (on disk or in its view); a request whose adapter this worker never sees, or whose files
never arrive whole, ends with an error after ADAPTER_WAIT_S rather than waiting for ever.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from gpu_consumers.engine import LoraRequest
from infra import adapters
from infra.config import adapter_cache_dir
from schemas.records import InferenceRequested

log = logging.getLogger("tokenmill.worker")

# How long a request waits for its adapter to appear in this worker's view (it was registered a moment
# ago and the view lags) before it ends with an error.
ADAPTER_WAIT_S = 10.0
ADAPTER_WAITING = object()
MAX_WAITING = 10_000


class AdapterUnavailable(Exception):
    def __init__(self, message: str, status: int, code: str):
        super().__init__(message)
        self.status, self.code = status, code


class AdapterCache:
    def __init__(self, worker_id: str, cache_dir: Path | None = None, wait_s: float = ADAPTER_WAIT_S):
        self.worker_id = worker_id
        self.cache_dir = Path(cache_dir) if cache_dir is not None else adapter_cache_dir(worker_id)
        self.wait_s = wait_s
        self.follower: adapters.AdapterFollower | None = None
        self._waiting: dict[str, float] = {}  # request id -> when it first waited for its adapter
        self.materialised = 0

    @property
    def catalog(self) -> adapters.AdapterCatalog:
        if self.follower is None:
            self.follower = adapters.AdapterFollower(f"{self.worker_id}-adapters", keep_chunks=True)
        return self.follower.catalog

    def start(self, wait: float = 15.0) -> None:
        # A cache: what an earlier run of this worker wrote may belong to adapters deleted since.
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.catalog  # noqa: B018 - makes the follower
        assert self.follower is not None
        self.follower.start(wait)

    def stop(self) -> None:
        if self.follower is not None:
            self.follower.stop()

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def lora_for(self, record: InferenceRequested):
        """The request's LoraRequest, None for the base model, ADAPTER_WAITING while its adapter is not
        here yet; raises AdapterUnavailable when it will not be."""
        ref = record.get("adapter")
        if not ref:
            return None
        engine_id = adapters.engine_adapter_id(ref)
        path = self.cache_dir / ref["version"]
        if (path / adapters.WEIGHTS_FILE).is_file():
            return LoraRequest(engine_id, str(path))
        follower = self.follower
        lock = follower.lock if follower is not None else None
        catalog = self.catalog
        if lock is not None:
            with lock:
                manifest = catalog.get(ref["adapter_id"])
                weights = catalog.weights(manifest) if manifest and manifest["version"] == ref["version"] else None
        else:
            manifest, weights = None, None
        if weights is not None and manifest is not None:
            written = adapters.materialise(manifest, weights, self.cache_dir)
            self.materialised += 1
            log.info("adapter %s (version %s) written to %s", ref["adapter_id"], ref["version"][:12], written)
            return LoraRequest(engine_id, str(written))
        request_id = record["request_id"] or ""
        first = self._waiting.setdefault(request_id, time.monotonic())
        if len(self._waiting) > MAX_WAITING:
            self._waiting.pop(next(iter(self._waiting)))
        if time.monotonic() - first < self.wait_s:
            return ADAPTER_WAITING
        self._waiting.pop(request_id, None)
        if manifest is None or manifest["version"] != ref["version"]:
            raise AdapterUnavailable(f"The adapter '{ref['name']}' was deleted before the request started.", 404,
                                     "model_not_found")
        raise AdapterUnavailable(f"The files of adapter '{ref['name']}' did not reach the worker "
                                 f"({self.wait_s:g} s).", 503, "adapter_unavailable")
