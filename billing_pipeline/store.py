"""The one way billing code reaches ClickHouse.

`TOKENMILL_CLICKHOUSE_URL` picks the engine:

* ``chdb:///abs/dir`` (default: ``chdb://`` + ``.local/clickhouse``): the embedded chDB engine.
  chDB allows **one data directory per process** and **one process per directory**, so the
  billing process owns it and everybody else asks the billing HTTP service.
* ``http(s)://user:pass@host:8123``: a ClickHouse server; the same code runs against it.

All billing tables live in one database (``TOKENMILL_CLICKHOUSE_DATABASE``, default
``tokenmill``); SQL names tables as ``{db}.table`` so a client never depends on ``USE``.
Each thread gets its own client (chDB clients on one directory share the engine).
"""
from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit, urlunsplit

import clickhouse_connect

from infra.paths import local_dir
from infra import settings

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def default_url() -> str:
    return settings.CLICKHOUSE_URL.get() or f"chdb://{(local_dir() / 'clickhouse').resolve()}"


def default_database() -> str:
    return settings.CLICKHOUSE_DATABASE.get()


def _connect(url: str):
    if url.startswith("chdb://"):
        path = url[len("chdb://"):]
        if not path:
            raise ValueError("a chdb URL needs a directory: chdb:///abs/dir")
        Path(path).mkdir(parents=True, exist_ok=True)
        return clickhouse_connect.get_client(dsn=f"chdb://{Path(path).resolve()}")
    if url.startswith(("http://", "https://")):
        return clickhouse_connect.get_client(dsn=url)
    raise ValueError(f"unsupported ClickHouse URL {url!r}: use chdb:///dir or http(s)://host:port")


class Store:
    """ClickHouse access for one billing database. Thread-safe (a client per thread)."""

    def __init__(self, url: str | None = None, database: str | None = None):
        self.url = url or default_url()
        self.database = database or default_database()
        if not _IDENT.match(self.database):
            raise ValueError(f"bad database name {self.database!r}")
        self._local = threading.local()
        self._clients: list[Any] = []
        self._lock = threading.Lock()
        self.client().command(f"CREATE DATABASE IF NOT EXISTS {self.database}")

    @property
    def display_url(self) -> str:
        """The URL without its password, for logs."""
        return redact_url(self.url)

    @property
    def is_embedded(self) -> bool:
        return self.url.startswith("chdb://")

    def client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            client = _connect(self.url)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def sql(self, text: str) -> str:
        """Fill in ``{db}`` with the billing database name."""
        return text.replace("{db}", self.database)

    def command(self, text: str, parameters: dict | None = None):
        return self.client().command(self.sql(text), parameters=parameters)

    def query(self, text: str, parameters: dict | None = None):
        return self.client().query(self.sql(text), parameters=parameters)

    def rows(self, text: str, parameters: dict | None = None) -> list[tuple]:
        return self.query(text, parameters).result_rows

    def dicts(self, text: str, parameters: dict | None = None) -> list[dict[str, Any]]:
        result = self.query(text, parameters)
        return [dict(zip(result.column_names, row)) for row in result.result_rows]

    def scalar(self, text: str, parameters: dict | None = None):
        rows = self.rows(text, parameters)
        return rows[0][0] if rows else None

    def insert(self, table: str, rows: Sequence[Sequence[Any]], column_names: Sequence[str]) -> None:
        if rows:
            self.client().insert(f"{self.database}.{table}", rows, column_names=list(column_names))

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            try:
                client.close()
            except Exception:  # closing is best effort
                pass
        self._local = threading.local()


_default: Store | None = None
_default_lock = threading.Lock()


def default_store() -> Store:
    """One Store per process for the configured URL (what the billing service uses)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Store()
        return _default


def set_default_store(store: Store | None) -> None:
    global _default
    with _default_lock:
        _default = store


def redact_url(url: str) -> str:
    """``scheme://user:secret@host/...`` -> ``scheme://user:***@host/...``; other URLs unchanged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
