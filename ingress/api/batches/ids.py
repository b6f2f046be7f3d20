"""Stable identifiers: the same tenant and file always give the same batch and request ids.

That makes a re-submission idempotent: streams drops request ids it has seen, and
the submitter itself skips a batch whose manifest says it was published.
"""
from __future__ import annotations

import hashlib
import re

from schemas import topics

SEED_MASK = (1 << 62) - 1


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big"))  # length-prefixed: no ambiguity between parts
        h.update(data)
    return h.hexdigest()


def canonical_model_map(model_map: dict[str, str] | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((model_map or {}).items()))


def batch_id(tenant_id: str, content: bytes, model_map: dict[str, str] | None = None) -> str:
    """`batch_<32 hex>` from the tenant and the file's bytes (and the model map, when one is given)."""
    parts: list[bytes | str] = ["tokenmill-batch/v1", tenant_id, content]
    if model_map:
        parts.append(canonical_model_map(model_map))
    return "batch_" + _digest(*parts)[:32]


def request_id(batch: str, custom_id: str) -> str:
    """32 hex characters, the shape of every other tokenmill request id."""
    return _digest("tokenmill-batch-request/v1", batch, custom_id)[:32]


def default_seed(batch: str, custom_id: str) -> int:
    """The seed of a line that gives none: stable, so a regenerated or resubmitted request is identical."""
    return int(_digest("tokenmill-batch-seed/v1", batch, custom_id)[:16], 16) & SEED_MASK


def result_partition(batch: str, partitions: int = topics.BATCH_RESULTS.partitions) -> int:
    return int(_digest("tokenmill-batch-partition/v1", batch)[:8], 16) % partitions


def file_id(kind: str, batch: str | None = None, nonce: str | None = None) -> str:
    """`file-...`: an upload's id (random nonce) or a batch's output/error file (derived)."""
    if batch is not None:
        return f"file-{batch.removeprefix('batch_')}-{kind}"
    return f"file-{nonce}"


_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# OpenAI accepts only "24h"; shorter windows are tokenmill's own. A longer one would let a batch
# hold its tenant's queue share (and its files) for as long as its submitter liked.
MAX_WINDOW_S = 86400.0


def parse_window(text: str) -> float:
    """`24h`, `90m`, `3600s`, `2d` -> seconds; ValueError otherwise."""
    m = _WINDOW.match(text or "")
    if not m:
        raise ValueError(f"completion_window must look like '24h' (got {text!r})")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError("completion_window must be positive")
    if seconds > MAX_WINDOW_S:
        raise ValueError(f"completion_window may be at most 24h (got {text!r})")
    return seconds
