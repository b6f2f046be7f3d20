"""A worker's tenants' LoRA adapters: its view of the `adapters` topic (manifests and chunks,
lora/adapters.py) and the local directory each one is written to the first time a request needs it,
in PEFT's layout, which the engine loads (gpu_consumers/engine: LoraRequest(adapter_id, path)).

A request names its adapter's id and version (InferenceRequested.adapter); both come from `work`, so both
are checked before either names a path: the version is a sha-256 in hex, the id is the request's own
tenant's. A request starts only while its version is the live one in this worker's view: a takedown (a
delete, or a new version registered under the name) stops new starts at once, and the old version's files
leave the disk; a request already running finishes. A request whose adapter this worker has not seen yet,
or whose files are not whole yet, waits up to ADAPTER_WAIT_S (the view lags a registration a moment), then
ends with an error rather than waiting for ever.

Writing an adapter (join its chunks, check their hash, write up to 64 MiB) runs on a thread of its own:
on the step loop it would stall every stream of this worker.
"""
from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from gpu_consumers.engine import LoraRequest
from lora import adapters
from infra.config import adapter_cache_dir
from schemas import checks
from schemas.records import AdapterManifest, InferenceRequested

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
        self._writing: dict[str, Future] = {}  # version -> its directory being written
        self._writer: ThreadPoolExecutor | None = None
        self.materialised = 0
        self._swept_at = -1  # the view's `changes` at the last disk sweep

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
        if self._writer is not None:
            self._writer.shutdown(wait=True, cancel_futures=True)

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def sweep_disk(self) -> list[str]:
        """Remove the directories of versions taken down since they were written (a deleted adapter, or
        one registered again); returns the versions removed. Cheap when the view has not changed."""
        follower = self.follower
        if follower is None or not self.cache_dir.is_dir() or self.catalog.changes == self._swept_at:
            return []
        with follower.lock:
            self._swept_at = self.catalog.changes
            live = {m["version"] for m in self.catalog.manifests.values()}
        writing = {version for version, fut in self._writing.items() if not fut.done()}
        gone = [d for d in self.cache_dir.iterdir()
                if d.is_dir() and not d.name.startswith(".") and d.name not in live and d.name not in writing]
        for d in gone:
            shutil.rmtree(d, ignore_errors=True)
        return [d.name for d in gone]

    def settle(self, timeout: float = 30.0) -> None:
        """Wait for the directories being written (tests; a worker never blocks on them)."""
        for fut in list(self._writing.values()):
            fut.exception(timeout)

    def _live(self, ref) -> tuple[AdapterManifest | None, list[bytes] | None]:
        """The live manifest of the ref's adapter when it is the ref's version, and its chunks when whole."""
        follower = self.follower
        lock = follower.lock if follower is not None else None
        if lock is None:
            return None, None
        with lock:
            manifest = self.catalog.get(ref["adapter_id"])
            if manifest is None or manifest["version"] != ref["version"]:
                return None, None
            return manifest, self.catalog.chunk_list(manifest)

    def _write(self, manifest: AdapterManifest, chunks: list[bytes]) -> Path:
        weights = adapters.joined_weights(manifest, chunks)
        if weights is None:
            raise ValueError(f"the chunks of {manifest['adapter_id']} do not hash to its manifest's sha-256")
        written = adapters.materialise(manifest, weights, self.cache_dir)
        follower = self.follower
        if follower is not None:  # the files on disk are the copy served from now on
            with follower.lock:
                self.catalog.forget(manifest["adapter_id"], manifest["version"])
        self.materialised += 1
        log.info("adapter %s (version %s) written to %s", manifest["adapter_id"], manifest["version"][:12], written)
        return written

    def _written(self, manifest: AdapterManifest, chunks: list[bytes]) -> Path | None:
        """The version's directory once written; starts the write (off the step loop) the first time."""
        version = manifest["version"]
        fut = self._writing.get(version)
        if fut is None:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-adapter-write")
            self._writing[version] = self._writer.submit(self._write, manifest, chunks)
            return None
        if not fut.done():
            return None
        del self._writing[version]
        return fut.result()  # a failed write raises: that request ends with an error, the next one retries

    def lora_for(self, record: InferenceRequested):
        """The request's LoraRequest, None for the base model, ADAPTER_WAITING while its adapter is not
        here yet; raises AdapterUnavailable when it will not be."""
        ref = record.get("adapter")
        if not ref:
            return None
        problem = checks.adapter_ref_problem(ref, record.get("tenant_id"))
        if problem:  # a version is a directory name: never trusted before this
            raise AdapterUnavailable(f"The request names an impossible adapter ({problem}).", 400, "invalid_adapter")
        manifest, chunks = self._live(ref)
        path = self.cache_dir / ref["version"]
        if manifest is not None and (path / adapters.WEIGHTS_FILE).is_file():
            fut = self._writing.get(ref["version"])
            if fut is not None and fut.done():
                del self._writing[ref["version"]]
            return LoraRequest(adapters.engine_adapter_id(ref), str(path))
        if manifest is None and path.exists():  # this worker served it, so its view saw it taken down since
            shutil.rmtree(path, ignore_errors=True)
            raise AdapterUnavailable(f"The adapter '{ref['name']}' was deleted before the request started.", 404,
                                     "model_not_found")
        if manifest is not None and chunks is not None:
            try:
                written = self._written(manifest, chunks)
            except (OSError, ValueError) as exc:
                raise AdapterUnavailable(f"The adapter '{ref['name']}' could not be written on the worker "
                                         f"({exc}).", 503, "adapter_unavailable") from None
            if written is not None:
                return LoraRequest(adapters.engine_adapter_id(ref), str(written))
            return ADAPTER_WAITING
        request_id = record["request_id"] or ""
        first = self._waiting.setdefault(request_id, time.monotonic())
        if len(self._waiting) > MAX_WAITING:
            self._waiting.pop(next(iter(self._waiting)))
        if time.monotonic() - first < self.wait_s:
            return ADAPTER_WAITING
        self._waiting.pop(request_id, None)
        if manifest is None:
            raise AdapterUnavailable(f"The adapter '{ref['name']}' was deleted before the request started.", 404,
                                     "model_not_found")
        raise AdapterUnavailable(f"The files of adapter '{ref['name']}' did not reach the worker "
                                 f"({self.wait_s:g} s).", 503, "adapter_unavailable")
