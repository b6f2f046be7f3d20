"""Avro codec for every tokenmill event.

A message's value is schemaless Avro; two headers name its writer schema
(`tm-event`, `tm-schema-version`). Readers always decode into the newest version of
that schema, so a producer still on an older version keeps working (Avro schema
resolution fills the added fields from their defaults).
"""
from __future__ import annotations

import io
import json
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar, cast

import fastavro

from schemas import checks

SCHEMA_DIR = Path(__file__).parent / "avro"
EVENT_HEADER = "tm-event"
VERSION_HEADER = "tm-schema-version"


class UndecodableEvent(Exception):
    """Raised with a human-readable reason; consumers dead-letter the message."""


@dataclass(frozen=True)
class Event:
    name: str
    record: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.record[key]


Record = TypeVar("Record")


def record_of(event: Event, kind: type[Record]) -> Record:
    """The event's record typed as `kind`, its class in schemas/records.py (named as the event), so the
    type checker knows its fields. An event of another name is refused as undecodable here."""
    if event.name != kind.__name__:
        raise UndecodableEvent(f"expected a {kind.__name__} event, got {event.name}")
    return cast(Record, event.record)


def _versions() -> dict[str, dict[int, Path]]:
    found: dict[str, dict[int, Path]] = {}
    for path in SCHEMA_DIR.glob("*.v*.avsc"):
        name, version = path.name[: -len(".avsc")].rsplit(".v", 1)
        found.setdefault(name, {})[int(version)] = path
    return found


VERSIONS = _versions()
EVENT_NAMES = tuple(sorted(VERSIONS))


def latest_version(name: str) -> int:
    return max(VERSIONS[name])


@lru_cache(maxsize=None)
def parsed_schema(name: str, version: int | None = None):
    version = latest_version(name) if version is None else version
    return fastavro.parse_schema(json.loads(VERSIONS[name][version].read_text()))


def new_event(event_name: str, /, request_id: str | None = None, **fields: Any) -> dict[str, Any]:
    """A record of event `event_name` with the common envelope fields filled in."""
    if event_name not in VERSIONS:
        raise KeyError(f"unknown event {event_name!r}")
    return {
        "event_id": uuid.uuid4().hex,
        "request_id": request_id,
        "schema_version": latest_version(event_name),
        "timestamp_ms": int(time.time() * 1000),
        **fields,
    }


def encode(name: str, record: dict[str, Any]) -> tuple[bytes, list[tuple[str, bytes]]]:
    version = latest_version(name)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed_schema(name, version), record)
    headers = [(EVENT_HEADER, name.encode()), (VERSION_HEADER, str(version).encode())]
    return buf.getvalue(), headers


def _header(headers, key: str) -> str | None:
    if not headers:
        return None
    items = headers.items() if isinstance(headers, dict) else headers
    for k, v in items:
        if k == key:
            return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)
    return None


def decode(value: bytes | None, headers, expect: tuple[str, ...] | None = None, check: bool = False) -> Event:
    """Decode one message, or raise UndecodableEvent saying why.

    With `check`, a record that decodes but holds impossible values (schemas/checks.py) is refused too."""
    name = _header(headers, EVENT_HEADER)
    version_text = _header(headers, VERSION_HEADER)
    if name is None or version_text is None:
        raise UndecodableEvent("missing tm-event / tm-schema-version headers")
    if name not in VERSIONS:
        raise UndecodableEvent(f"unknown event type {name!r}")
    if expect is not None and name not in expect:
        raise UndecodableEvent(f"event {name!r} does not belong on this topic (expected {expect})")
    try:
        version = int(version_text)
        writer = parsed_schema(name, version)
    except (ValueError, KeyError):
        raise UndecodableEvent(f"unknown schema version {version_text!r} of {name}") from None
    if value is None:
        raise UndecodableEvent("empty message value")
    stream = io.BytesIO(value)
    # Resolving against the reader's schema is needed only for an older version, and costs as
    # much again as reading (the gate decodes every request, usage and advert).
    reader = None if version == latest_version(name) else parsed_schema(name)
    try:
        record = fastavro.schemaless_reader(stream, writer, reader)
    except Exception as exc:  # fastavro raises many types on garbage input
        raise UndecodableEvent(f"corrupt {name} payload: {type(exc).__name__}: {exc}") from None
    if not isinstance(record, dict):
        raise UndecodableEvent(f"a {name} payload that is not a record")
    if stream.tell() != len(value):
        raise UndecodableEvent(f"{len(value) - stream.tell()} trailing bytes after {name} payload")
    if check:
        found = checks.problems(name, record)
        if found:
            raise UndecodableEvent(f"impossible {name}: {'; '.join(found)}")
    return Event(name, record)
