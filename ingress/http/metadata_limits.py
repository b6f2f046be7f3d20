"""The caps OpenAI documents for `metadata` on every object that takes it (responses, batches): at most
16 pairs, keys of at most 64 characters, string values of at most 512. Stored metadata is kept for the
object's life and every replica holds it, so an uncapped map is memory any tenant could fill."""
from __future__ import annotations

from typing import Any

from http_api.openai_errors import APIError

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def checked_metadata(metadata: Any, param: str = "metadata") -> dict[str, str] | None:
    """`metadata` if it keeps the caps, else a 400 naming `param` and the cap it broke."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise APIError(400, f"{param} must map strings to strings.", param=param, code="invalid_value")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, f"{param} has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed.",
                       param=param, code="invalid_value")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise APIError(400, f"{param} keys may have at most {MAX_METADATA_KEY_CHARS} characters.",
                           param=param, code="invalid_value")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise APIError(400, f"{param} values may have at most {MAX_METADATA_VALUE_CHARS} characters.",
                           param=param, code="invalid_value")
    return metadata
