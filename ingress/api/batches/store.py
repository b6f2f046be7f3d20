"""Batch state on the local disk of the machine that submitted it.

```
<root>/<batch_id>/manifest.json   the batch: tenant, reply address, deadline, every request id
<root>/<batch_id>/errors.jsonl    lines refused at submission (validation errors)
<root>/files/<file_id>/meta.json  an uploaded or produced file (HTTP API), with its owner
<root>/files/<file_id>/content
<root>/by-tenant/<hash>/<batch_id>, <root>/files-by-tenant/<hash>/<file_id>   each tenant's own (empty markers)
```

A file may expire (`expires_at` in its metadata, from `expires_after`): from then on it is gone for every
route and deleted from disk the next time it is looked at.

`<root>` is `$TOKENMILL_BATCH_DIR`, else `.local/batches/`. Every write goes to a
temporary file first and is renamed into place, so a crash never leaves half a manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from infra.paths import local_dir
from infra import settings

_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # fullmatch: "$" would let a trailing newline in


def default_root() -> Path:
    return settings.BATCH_DIR.get()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def jsonl(rows) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for r in rows)


class BatchStore:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else default_root()
        self._lock = threading.Lock()

    # --- batches ---
    def batch_dir(self, batch_id: str) -> Path:
        if not _SAFE_ID.fullmatch(batch_id):
            raise KeyError(batch_id)
        return self.root / batch_id

    def load(self, batch_id: str) -> dict[str, Any] | None:
        try:
            path = self.batch_dir(batch_id) / "manifest.json"
        except KeyError:
            return None
        if not path.exists():
            return None
        return json.loads(path.read_text())

    def save(self, manifest: dict[str, Any]) -> None:
        path = self.batch_dir(manifest["batch_id"]) / "manifest.json"
        _atomic_write(path, json.dumps(manifest, indent=1, ensure_ascii=False).encode())
        marker = self._tenant_index(manifest["tenant_id"]) / manifest["batch_id"]
        if not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()

    def _tenant_index(self, tenant_id: str) -> Path:
        """One folder of batch ids per tenant, so a tenant's listing reads its own manifests only
        (named by a hash: tenant ids are not path-safe)."""
        return self.root / "by-tenant" / hashlib.sha256(tenant_id.encode()).hexdigest()[:32]

    def _ensure_index(self) -> None:
        """Batches saved before the index existed are indexed once."""
        done = self.root / "by-tenant" / ".built"
        if done.exists() or not self.root.exists():
            return
        with self._lock:
            if done.exists():
                return
            for path in self.root.glob("batch_*/manifest.json"):
                manifest = json.loads(path.read_text())
                marker = self._tenant_index(manifest["tenant_id"]) / manifest["batch_id"]
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            done.parent.mkdir(parents=True, exist_ok=True)
            done.touch()

    def update(self, batch_id: str, **changes: Any) -> dict[str, Any]:
        with self._lock:
            manifest = self.load(batch_id)
            if manifest is None:
                raise KeyError(batch_id)
            manifest.update(changes)
            self.save(manifest)
            return manifest

    def write_errors(self, batch_id: str, rows: list[dict[str, Any]]) -> Path:
        path = self.batch_dir(batch_id) / "errors.jsonl"
        _atomic_write(path, jsonl(rows))
        return path

    def read_errors(self, batch_id: str) -> list[dict[str, Any]]:
        path = self.batch_dir(batch_id) / "errors.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def list_batches(self, tenant_id: str | None = None) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        if not self.root.exists():
            return found
        paths: Iterable[Path]
        if tenant_id is None:
            paths = self.root.glob("batch_*/manifest.json")
        else:
            self._ensure_index()
            folder = self._tenant_index(tenant_id)
            paths = [self.root / m.name / "manifest.json" for m in folder.iterdir()] if folder.exists() else []
        for path in paths:
            if not path.exists():
                continue
            manifest = json.loads(path.read_text())
            if tenant_id is None or manifest["tenant_id"] == tenant_id:
                found.append(manifest)
        return sorted(found, key=lambda m: (m["created_at_ms"], m["batch_id"]), reverse=True)

    # --- files (HTTP API) ---
    def _file_dir(self, file_id: str) -> Path:
        if not _SAFE_ID.fullmatch(file_id):
            raise KeyError(file_id)
        return self.root / "files" / file_id

    def _files_index(self, tenant_id: str) -> Path:
        """One folder of file ids per tenant (as `_tenant_index` for batches): a tenant's listing and its
        bytes read its own files' metadata only, never every tenant's."""
        return self.root / "files-by-tenant" / hashlib.sha256(tenant_id.encode()).hexdigest()[:32]

    def _ensure_files_index(self) -> None:
        """Files stored before the index existed are indexed once."""
        done = self.root / "files-by-tenant" / ".built"
        if done.exists():
            return
        with self._lock:
            if done.exists():
                return
            for path in (self.root / "files").glob("*/meta.json"):
                meta = json.loads(path.read_text())
                marker = self._files_index(meta["tenant_id"]) / meta["id"]
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            done.parent.mkdir(parents=True, exist_ok=True)
            done.touch()

    def put_file(self, tenant_id: str, filename: str, purpose: str, content: bytes,
                 file_id: str | None = None, expires_at: int | None = None) -> dict[str, Any]:
        """`expires_at` (seconds since the epoch): from then on the file is gone (404, not listed, deleted
        from disk when next seen)."""
        self._ensure_files_index()
        file_id = file_id or f"file-{secrets.token_hex(12)}"
        meta = {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed", "status_details": None,
                "tenant_id": tenant_id, "expires_at": expires_at}
        folder = self._file_dir(file_id)
        _atomic_write(folder / "content", content)
        _atomic_write(folder / "meta.json", json.dumps(meta).encode())
        marker = self._files_index(tenant_id) / file_id
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return meta

    @staticmethod
    def _expired(meta: dict[str, Any]) -> bool:
        return meta.get("expires_at") is not None and meta["expires_at"] <= time.time()

    def file_meta(self, file_id: str) -> dict[str, Any] | None:
        try:
            path = self._file_dir(file_id) / "meta.json"
        except KeyError:
            return None
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        if self._expired(meta):
            self.delete_file(file_id)
            return None
        return meta

    def file_content(self, file_id: str) -> bytes:
        return (self._file_dir(file_id) / "content").read_bytes()

    def delete_file(self, file_id: str) -> None:
        folder = self._file_dir(file_id)
        meta_path = folder / "meta.json"
        try:
            tenant_id = json.loads(meta_path.read_text())["tenant_id"]
        except FileNotFoundError:
            tenant_id = None
        for name in ("meta.json", "content"):
            (folder / name).unlink(missing_ok=True)
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass
        if tenant_id is not None:
            (self._files_index(tenant_id) / file_id).unlink(missing_ok=True)

    def list_files(self, tenant_id: str) -> list[dict[str, Any]]:
        """The tenant's files that have not expired, newest first (its own metadata only is read)."""
        self._ensure_files_index()
        folder = self._files_index(tenant_id)
        if not folder.exists():
            return []
        metas = []
        for marker in folder.iterdir():
            meta = self.file_meta(marker.name)
            if meta is None:
                marker.unlink(missing_ok=True)  # deleted or expired meanwhile
            elif meta["tenant_id"] == tenant_id:
                metas.append(meta)
        return sorted(metas, key=lambda m: (m["created_at"], m["id"]), reverse=True)

    def file_bytes(self, tenant_id: str) -> int:
        """What the tenant's files that have not expired take, counted against its files quota."""
        return sum(m["bytes"] for m in self.list_files(tenant_id))
