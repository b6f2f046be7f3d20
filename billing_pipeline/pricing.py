"""Prices per model and token kind, with effective dates.

A price is stored as an integer number of pico-USD per token, which is the same number as
micro-USD per million tokens: ``usd_per_mtok=0.15`` is stored as 150000. Costs are then exact
integers (tokens x price). The ledger stores the cost computed **at insert**, from the price in
effect at the request's ``finished_at``; model ``*`` is the fallback for models with no price.
A LoRA adapter may have prices of its own under its model id ``<base>:<adapter>``; an adapter
without them pays its base model's.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from decimal import Decimal

from billing_pipeline.store import Store

TOKEN_KINDS = ("input", "cached_input", "output")
DEFAULT_MODEL = "*"


def usd_per_mtok_to_pusd(usd_per_mtok) -> int:
    value = Decimal(str(usd_per_mtok)) * 1_000_000
    if value != value.to_integral_value() or value < 0:
        raise ValueError(f"price {usd_per_mtok} USD/Mtok needs at most 6 decimals and must be >= 0")
    return int(value)


def to_ms(value) -> int:
    """Epoch ms from an int (ms), a datetime (naive = UTC) or an ISO string."""
    if isinstance(value, bool):
        raise TypeError("not a time")
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return int(value.timestamp() * 1000)
    raise TypeError(f"cannot read a time from {value!r}")


def set_price(store: Store, model: str, token_kind: str, usd_per_mtok, effective_from=None) -> dict:
    """Record a price; ``effective_from`` defaults to now. Prefer future dates: rows already in
    the ledger keep the cost they were inserted with."""
    if token_kind not in TOKEN_KINDS:
        raise ValueError(f"token_kind must be one of {TOKEN_KINDS}")
    if not model:
        raise ValueError("model must not be empty ('*' is the default price)")
    pusd = usd_per_mtok_to_pusd(usd_per_mtok)
    eff = to_ms(effective_from) if effective_from is not None else int(time.time() * 1000)
    store.insert("prices", [[model, token_kind, eff, pusd, time.time_ns() // 1_000_000]],
                 ["model", "token_kind", "effective_from", "pusd_per_token", "created_at"])
    return {"model": model, "token_kind": token_kind, "effective_from_ms": eff, "pusd_per_token": pusd,
            "usd_per_mtok": pusd / 1_000_000}


def list_prices(store: Store) -> list[dict]:
    return [
        {"model": m, "token_kind": k, "effective_from_ms": int(e), "pusd_per_token": int(p),
         "usd_per_mtok": int(p) / 1_000_000}
        for m, k, e, p in store.rows(
            "SELECT model, token_kind, toUnixTimestamp64Milli(effective_from), pusd_per_token "
            "FROM {db}.prices FINAL ORDER BY model, token_kind, effective_from")
    ]


@dataclass
class PriceBook:
    """An in-memory copy of the price table: the price of (model, kind) at a time."""

    _table: dict[tuple[str, str], tuple[list[int], list[int]]] = field(default_factory=dict)

    @classmethod
    def load(cls, store: Store) -> "PriceBook":
        book = cls()
        for p in list_prices(store):
            starts, prices = book._table.setdefault((p["model"], p["token_kind"]), ([], []))
            starts.append(p["effective_from_ms"])
            prices.append(p["pusd_per_token"])
        return book

    def price(self, model: str, kind: str, at_ms: int, adapter: str | None = None) -> int | None:
        keys = ((model, kind), (DEFAULT_MODEL, kind))
        if adapter:
            keys = ((f"{model}:{adapter}", kind), *keys)
        for key in keys:
            entry = self._table.get(key)
            if entry:
                i = bisect.bisect_right(entry[0], at_ms) - 1
                if i >= 0:
                    return entry[1][i]
        return None
