"""What a request's reply events are, wherever they are read from (this process's reply partition, or
`batch-results` for a background response): a ReplyBatch's item for it, or the RequestError that ends it."""
from __future__ import annotations

from typing import Literal

from schemas.records import ReplyItem, RequestError

ReplyEvent = tuple[Literal["item"], ReplyItem] | tuple[Literal["error"], RequestError]
