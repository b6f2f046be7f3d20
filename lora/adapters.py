"""Registered LoRA adapters on the compacted `adapters` topic (docs/lora.md, "Registry, API and billing").

An adapter is a tenant's: its id is ``<tenant>/<name>`` (the key of its manifest) and callers name it
as the model id ``<base>:<name>``, which resolves only for its own tenant. Its files travel as events:
the AdapterChunk records of ``adapter_model.safetensors`` (keyed ``<id>@<version>#<i>``), then the
AdapterManifest (keyed ``<id>``, carrying adapter_config.json), all in the partition of the id, so a
reader that has the manifest has read its chunks. Deleting writes tombstones for the manifest and every
chunk. Every ingress follows the manifests (resolution, /v1/models); every worker follows manifests and
chunks, and writes an adapter into its cache directory the first time a request needs it.

Shared by ingress (registration, resolution), the CLI and the workers; validation of the files is
not here (ingress/tenancy/adapter_registry.py reuses the engine's validation module).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from confluent_kafka import OFFSET_BEGINNING, KafkaException, Producer

from formats.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from infra.kafka.compacted_view import CompactedFollower
from schemas import checks, codec, topics
from schemas.records import AdapterChunk, AdapterManifest, AdapterRef

log = logging.getLogger(__name__)

# What an adapter's name may be: it becomes part of a model id, a Kafka key, a ledger value and a directory
# name, so it is short, lower case, and holds no ':' (the model id's separator), '/', '@' or '#'.
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
NAME_RULE = "1 to 64 characters of a-z, 0-9, '.', '_' or '-', starting with a letter or digit"
SEPARATOR = ":"


def adapter_id(tenant_id: str, name: str) -> str:
    return f"{tenant_id}/{name}"


def model_id(base_model: str, name: str) -> str:
    return f"{base_model}{SEPARATOR}{name}"


def split_model_id(model: str) -> tuple[str, str] | None:
    """(base, name) of a model id that names an adapter; None when it cannot be one."""
    base, sep, name = model.rpartition(SEPARATOR)
    if not sep or not base or not NAME_PATTERN.fullmatch(name):
        return None
    return base, name


def engine_adapter_id(manifest: AdapterManifest | AdapterRef | dict) -> str:
    """The engine's name for one registered version (LoraRequest.adapter_id): a name registered again
    after a delete is another adapter to the engine's slots and prefix cache."""
    return f"{manifest['adapter_id']}@{manifest['version'][:12]}"


def version_of(adapter_config: str, weights: bytes) -> str:
    h = hashlib.sha256()
    h.update(adapter_config.encode())
    h.update(b"\0")
    h.update(weights)
    return h.hexdigest()


def partition_of(adapter: str, partitions: int) -> int:
    """Every record of one adapter (manifest, chunks, tombstones) goes to this partition."""
    return zlib.crc32(adapter.encode()) % partitions


def new_records(*, tenant_id: str, name: str, base_model: str, adapter_config: str, weights: bytes, rank: int,
                target_modules: Iterable[str], chunk_bytes: int = topics.ADAPTER_CHUNK_BYTES
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The manifest and chunk records of one registration."""
    aid = adapter_id(tenant_id, name)
    version = version_of(adapter_config, weights)
    pieces = [weights[i:i + chunk_bytes] for i in range(0, len(weights), chunk_bytes)] or [b""]
    chunks = [codec.new_event("AdapterChunk", adapter_id=aid, version=version, index=i, chunk_count=len(pieces),
                              data=piece) for i, piece in enumerate(pieces)]
    manifest = codec.new_event(
        "AdapterManifest", adapter_id=aid, tenant_id=tenant_id, name=name, base_model=base_model, version=version,
        rank=int(rank), target_modules=list(target_modules), adapter_config=adapter_config,
        weights_bytes=len(weights), weights_sha256=hashlib.sha256(weights).hexdigest(), chunk_count=len(pieces),
        created_ms=int(time.time() * 1000))
    return manifest, chunks


class AdapterPublisher:
    """Writes registrations and deletions to `adapters`, each acknowledged before it returns."""

    def __init__(self, client_id: str = "adapter-admin"):
        self.producer = Producer(kafka_clients.producer_config(client_id))
        self._partitions: int | None = None

    def _partition(self, adapter: str) -> int:
        if self._partitions is None:
            self._partitions = len(topic_reader.partitions(topics.ADAPTERS.name)) or topics.ADAPTERS.partitions
        return partition_of(adapter, self._partitions)

    def _send(self, items: list[tuple[str, str | None, dict[str, Any] | None]], partition: int) -> None:
        failures: list[str] = []

        def on_delivery(err, _msg):
            if err is not None:
                failures.append(str(err))

        for key, name, record in items:
            if record is None:
                while True:
                    try:
                        self.producer.produce(topics.ADAPTERS.name, key=key, value=None, partition=partition,
                                              on_delivery=on_delivery)
                        break
                    except BufferError:
                        self.producer.poll(0.05)
            else:
                assert name is not None
                kafka_clients.produce_event(self.producer, topics.ADAPTERS.name, key, name, record,
                                            partition=partition, on_delivery=on_delivery)
        if self.producer.flush(30) != 0 or failures:
            raise RuntimeError(f"the adapter was not acknowledged by Kafka ({failures[:1] or 'timed out'})")

    def publish(self, manifest: dict[str, Any], chunks: list[dict[str, Any]]) -> None:
        """Chunks first, then the manifest, in one partition: whoever reads the manifest has its chunks. A
        publish that fails tombstones its chunks again (best effort; the sweep takes what that misses)."""
        chunk_keys = [checks.adapter_chunk_key(c["adapter_id"], c["version"], c["index"]) for c in chunks]
        items: list[tuple[str, str | None, dict[str, Any] | None]] = [
            (key, "AdapterChunk", c) for key, c in zip(chunk_keys, chunks)]
        items.append((manifest["adapter_id"], "AdapterManifest", manifest))
        partition = self._partition(manifest["adapter_id"])
        try:
            self._send(items, partition)
        except (RuntimeError, KafkaException):
            try:
                self.tombstone(chunk_keys, manifest["adapter_id"])
            except (RuntimeError, KafkaException):
                log.warning("adapter %s: chunks of a failed registration left for the sweep", manifest["adapter_id"])
            raise

    def tombstone(self, keys: Iterable[str], aid: str) -> None:
        """Tombstones for chunk keys of adapter `aid` (its partition)."""
        self._send([(key, None, None) for key in keys], self._partition(aid))

    def delete(self, manifest: AdapterManifest | dict[str, Any], chunk_keys: Iterable[str] = ()) -> None:
        """Tombstones: the manifest first (no new request resolves it from then on), then its chunks and
        `chunk_keys` (every chunk the topic holds of that id, of any version)."""
        aid = manifest["adapter_id"]
        keys = {checks.adapter_chunk_key(aid, manifest["version"], i) for i in range(manifest["chunk_count"])}
        keys.update(chunk_keys)
        items: list[tuple[str, str | None, dict[str, Any] | None]] = [(aid, None, None)]
        items += [(key, None, None) for key in sorted(keys)]
        self._send(items, self._partition(aid))

    def close(self) -> None:
        self.producer.flush(10)


def split_chunk_key(key: str) -> tuple[str, str, str]:
    """(adapter id, version, index) of a chunk key <id>@<version>#<i>."""
    aid, _, rest = key.rpartition("@")
    version, _, index = rest.partition("#")
    return aid, version, index


@dataclass
class AdapterCatalog:
    """Pure state: the live manifests (by adapter id), every chunk key the topic holds now (with the time
    its record was written, for the orphan sweep) and, when kept, the chunks' bytes. Bytes are kept only
    for versions that may still be served: a manifest drops its id's other versions, `forget` drops a
    version written to disk, `prune` drops versions no manifest names (after a catch-up)."""
    keep_chunks: bool = False
    manifests: dict[str, AdapterManifest] = field(default_factory=dict)
    chunks: dict[tuple[str, str], dict[int, bytes]] = field(default_factory=dict)
    chunk_keys: dict[str, int] = field(default_factory=dict)  # chunk key -> its record's time (ms)
    changes: int = 0

    def apply_manifest(self, aid: str, manifest: AdapterManifest | None) -> None:
        self.changes += 1
        self.manifests.pop(aid, None)
        keep = manifest["version"] if manifest is not None else None
        for key in [k for k in self.chunks if k[0] == aid and k[1] != keep]:
            del self.chunks[key]
        if manifest is not None:
            self.manifests[aid] = manifest

    def apply_chunk(self, key: str, chunk: AdapterChunk | None, written_ms: int = 0) -> None:
        if chunk is None:  # tombstone: <id>@<version>#<i>
            self.chunk_keys.pop(key, None)
            aid, version, index = split_chunk_key(key)
            held = self.chunks.get((aid, version))
            if held is not None and index.isdigit():
                held.pop(int(index), None)
                if not held:
                    del self.chunks[(aid, version)]
            return
        self.chunk_keys[key] = written_ms
        if self.keep_chunks:
            self.chunks.setdefault((chunk["adapter_id"], chunk["version"]), {})[chunk["index"]] = chunk["data"]

    def forget(self, aid: str, version: str) -> None:
        """Drop the bytes of a version (written to disk: the copy there is the one served)."""
        self.chunks.pop((aid, version), None)

    def prune(self) -> int:
        """Drop the bytes of versions no live manifest names; how many versions went."""
        live = {(aid, m["version"]) for aid, m in self.manifests.items()}
        stale = [k for k in self.chunks if k not in live]
        for k in stale:
            del self.chunks[k]
        return len(stale)

    def orphan_chunk_keys(self, older_than_ms: int) -> list[str]:
        """Chunk keys no live manifest names, written before `older_than_ms` (a registration publishes its
        chunks before its manifest: a newer orphan may be one in flight)."""
        live = {(aid, m["version"]) for aid, m in self.manifests.items()}
        return sorted(k for k, at in self.chunk_keys.items()
                      if at < older_than_ms and split_chunk_key(k)[:2] not in live)

    def chunk_keys_of(self, aid: str) -> list[str]:
        return sorted(k for k in self.chunk_keys if split_chunk_key(k)[0] == aid)

    def usage_of(self, tenant_id: str) -> tuple[int, int]:
        """(live adapters, their bytes) of a tenant."""
        mine = [m for m in self.manifests.values() if m["tenant_id"] == tenant_id]
        return len(mine), sum(m["weights_bytes"] for m in mine)

    def get(self, aid: str) -> AdapterManifest | None:
        return self.manifests.get(aid)

    def resolve(self, tenant_id: str, model: str) -> AdapterManifest | None:
        """The tenant's adapter a model id names, or None (another tenant's adapter is None too)."""
        parts = split_model_id(model)
        if parts is None:
            return None
        found = self.manifests.get(adapter_id(tenant_id, parts[1]))
        return found if found is not None and found["base_model"] == parts[0] else None

    def of_tenant(self, tenant_id: str) -> list[AdapterManifest]:
        return sorted((m for m in self.manifests.values() if m["tenant_id"] == tenant_id), key=lambda m: m["name"])

    def chunk_list(self, manifest: AdapterManifest) -> list[bytes] | None:
        """A manifest's chunks in order, or None while one is missing (cheap: no copy of the bytes)."""
        held = self.chunks.get((manifest["adapter_id"], manifest["version"]), {})
        if any(i not in held for i in range(manifest["chunk_count"])):
            return None
        return [held[i] for i in range(manifest["chunk_count"])]

    def weights(self, manifest: AdapterManifest) -> bytes | None:
        """The safetensors bytes of a manifest's version, or None while a chunk is missing or they do not
        hash to what the manifest says."""
        chunks = self.chunk_list(manifest)
        return joined_weights(manifest, chunks) if chunks is not None else None


def joined_weights(manifest: AdapterManifest, chunks: list[bytes]) -> bytes | None:
    """The chunks joined, or None when they do not hash to what the manifest says."""
    data = b"".join(chunks)
    return data if hashlib.sha256(data).hexdigest() == manifest["weights_sha256"] else None


class AdapterFollower:
    """Keeps an AdapterCatalog current from `adapters` (`start`: forever; `catch_up`: once, to its end)."""

    def __init__(self, client_id: str, keep_chunks: bool = False, dead_letters: bool = True):
        self.catalog = AdapterCatalog(keep_chunks=keep_chunks)
        self.client_id = client_id
        self.dead_letters = kafka_clients.DeadLetters(client_id if dead_letters else None)
        self.lock = threading.Lock()
        self.follower = CompactedFollower(topics.ADAPTERS.name, client_id, self._handle,
                                          dead_letters=self.dead_letters)

    def _handle(self, msg) -> None:
        try:
            key = msg.key().decode() if msg.key() else None
        except UnicodeDecodeError as exc:
            self.dead_letters.unprocessable(msg, exc)
            return
        if key is None:
            return
        with self.lock:
            if msg.value() is None:
                if "@" in key:
                    self.catalog.apply_chunk(key, None)
                else:
                    self.catalog.apply_manifest(key, None)
                return
            name = dict(msg.headers() or []).get(codec.EVENT_HEADER, b"").decode(errors="replace")
            written_ms = msg.timestamp()[1]
            if name == "AdapterChunk" and not self.catalog.keep_chunks:
                self.catalog.chunk_keys[key] = written_ms  # this view never needs the bytes: not decoded
                return
            event = self.dead_letters.decode(msg, ("AdapterManifest", "AdapterChunk"))
            if event is None:
                return
            problem = checks.adapter_key_problem(event.name, event.record, key)
            if problem:
                self.dead_letters.send(msg, problem)
                return
            if event.name == "AdapterManifest":
                self.catalog.apply_manifest(key, codec.record_of(event, AdapterManifest))
            else:
                self.catalog.apply_chunk(key, codec.record_of(event, AdapterChunk), written_ms)

    def start(self, wait: float = 15.0) -> None:
        self.follower.start()
        self.follower.wait_caught_up(wait)
        with self.lock:  # what the topic held of versions no manifest names (orphans) is not kept
            self.catalog.prune()

    def stop(self) -> None:
        self.follower.stop()

    async def settled(self, timeout_s: float = 5.0) -> bool:
        return await self.follower.settled(timeout_s)

    def catch_up(self, timeout: float = 30.0) -> AdapterCatalog:
        """Read the topic once to its current end (the CLI); raises TimeoutError rather than answer from part."""
        name = topics.ADAPTERS.name
        ends = kafka_clients.with_retries(lambda: topic_reader.end_offsets(name, self.client_id),
                                          "reading `adapters` metadata")
        for msg in topic_reader.read_to_end({(name, p): OFFSET_BEGINNING for p in ends}, self.client_id, timeout,
                                            ends={(name, p): end for p, end in ends.items()}):
            self._handle(msg)
        self.catalog.prune()
        return self.catalog


# A registration publishes its chunks before its manifest; an orphan younger than this may be one in flight.
SWEEP_GRACE_S = 600.0


def sweep(publisher: AdapterPublisher, catalog: AdapterCatalog, grace_s: float = SWEEP_GRACE_S) -> list[str]:
    """Tombstone every chunk no live manifest names (a failed registration's, an old version's), older
    than `grace_s`; returns their keys. `catalog`: a fresh catch-up of the topic."""
    orphans = catalog.orphan_chunk_keys(int((time.time() - grace_s) * 1000))
    by_adapter: dict[str, list[str]] = {}
    for key in orphans:
        by_adapter.setdefault(split_chunk_key(key)[0], []).append(key)
    for aid, keys in by_adapter.items():
        publisher.tombstone(keys, aid)
    return orphans


def public(manifest: AdapterManifest | dict[str, Any]) -> dict[str, Any]:
    """What the admin API and the CLI show of an adapter."""
    return {"id": model_id(manifest["base_model"], manifest["name"]), "object": "adapter",
            "tenant_id": manifest["tenant_id"], "name": manifest["name"], "base_model": manifest["base_model"],
            "version": manifest["version"], "rank": manifest["rank"], "target_modules": list(manifest["target_modules"]),
            "size_bytes": manifest["weights_bytes"], "created_ms": manifest["created_ms"]}


def materialise(manifest: AdapterManifest, weights: bytes, cache_dir: Path) -> Path:
    """The adapter's PEFT directory under `cache_dir`, written once per version (into a temporary
    directory renamed into place whole, so a crash never leaves half an adapter that looks whole)."""
    target = Path(cache_dir) / manifest["version"]
    if (target / WEIGHTS_FILE).is_file() and (target / CONFIG_FILE).is_file():
        return target
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=cache_dir))
    try:
        (tmp / CONFIG_FILE).write_text(manifest["adapter_config"])
        (tmp / WEIGHTS_FILE).write_bytes(weights)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # anything but another writer having got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
