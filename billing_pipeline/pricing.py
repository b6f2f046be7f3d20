"""Prices per model and token kind, with effective dates.

A price is stored as an integer number of pico-USD per token, which is the same number as
micro-USD per million tokens: ``usd_per_mtok=0.15`` is stored as 150000. Costs are then exact
integers (tokens x price). The ledger stores the cost computed **at insert**, from the price in
effect at the request's ``finished_at``; model ``*`` is the fallback for models with no price.

A price may be one tenant's (``tenant_id``; '' = every tenant's), and a LoRA adapter's price always is: an
adapter's name belongs to its tenant, so a price for ``<base>:<adapter>`` needs the tenant it is for and
bills that tenant's adapter only (another tenant's adapter of the same name pays its own price, or its
base model's). The lookup, most specific first: the tenant's adapter, the tenant's base model, the base
model, ``*``. Adapter prices recorded before tenants had prices (tenant '') are never used.
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


ADAPTER_SEPARATOR = ":"


def set_price(store: Store, model: str, token_kind: str, usd_per_mtok, effective_from=None,
              tenant_id: str = "") -> dict:
    """Record a price (``tenant_id``: that tenant's only; an adapter's model id needs one); ``effective_from``
    defaults to now. Prefer future dates: rows already in the ledger keep the cost they were inserted with."""
    if token_kind not in TOKEN_KINDS:
        raise ValueError(f"token_kind must be one of {TOKEN_KINDS}")
    if not model:
        raise ValueError("model must not be empty ('*' is the default price)")
    if not isinstance(tenant_id, str):
        raise TypeError("tenant_id must be a string")
    if ADAPTER_SEPARATOR in model and not tenant_id:
        raise ValueError(f"{model!r} names an adapter, whose name is one tenant's: give the tenant_id it is for")
    pusd = usd_per_mtok_to_pusd(usd_per_mtok)
    eff = to_ms(effective_from) if effective_from is not None else int(time.time() * 1000)
    store.insert("prices", [[model, tenant_id, token_kind, eff, pusd, time.time_ns() // 1_000_000]],
                 ["model", "tenant_id", "token_kind", "effective_from", "pusd_per_token", "created_at"])
    return {"model": model, "tenant_id": tenant_id, "token_kind": token_kind, "effective_from_ms": eff,
            "pusd_per_token": pusd, "usd_per_mtok": pusd / 1_000_000}


def list_prices(store: Store) -> list[dict]:
    return [
        {"model": m, "tenant_id": t, "token_kind": k, "effective_from_ms": int(e), "pusd_per_token": int(p),
         "usd_per_mtok": int(p) / 1_000_000}
        for m, t, k, e, p in store.rows(
            "SELECT model, tenant_id, token_kind, toUnixTimestamp64Milli(effective_from), pusd_per_token "
            "FROM {db}.prices FINAL ORDER BY model, tenant_id, token_kind, effective_from")
    ]


@dataclass
class PriceBook:
    """An in-memory copy of the price table: the price of (model, kind) at a time, every tenant's
    (``_table``) and single tenants' (``_tenants``, keyed (tenant, model, kind))."""

    _table: dict[tuple[str, str], tuple[list[int], list[int]]] = field(default_factory=dict)
    _tenants: dict[tuple[str, str, str], tuple[list[int], list[int]]] = field(default_factory=dict)

    @classmethod
    def load(cls, store: Store) -> "PriceBook":
        book = cls()
        for p in list_prices(store):
            if p["tenant_id"]:
                entry = book._tenants.setdefault((p["tenant_id"], p["model"], p["token_kind"]), ([], []))
            elif ADAPTER_SEPARATOR in p["model"]:
                continue  # an adapter price of no tenant (before migration 6): it would bill every tenant's
            else:
                entry = book._table.setdefault((p["model"], p["token_kind"]), ([], []))
            entry[0].append(p["effective_from_ms"])
            entry[1].append(p["pusd_per_token"])
        return book

    def price(self, model: str, kind: str, at_ms: int, adapter: str | None = None,
              tenant_id: str = "") -> int | None:
        entries = [self._tenants.get((tenant_id, model, kind)), self._table.get((model, kind)),
                   self._table.get((DEFAULT_MODEL, kind))]
        if adapter:
            entries.insert(0, self._tenants.get((tenant_id, f"{model}{ADAPTER_SEPARATOR}{adapter}", kind)))
        for entry in entries:
            if entry:
                i = bisect.bisect_right(entry[0], at_ms) - 1
                if i >= 0:
                    return entry[1][i]
        return None
