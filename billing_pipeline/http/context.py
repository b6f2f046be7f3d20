"""What every billing route works with, made once by the composition root (service.py) and reached by
a route through the typed `Context` dependency (the app's state), never as a global."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from billing_pipeline.consumer import LedgerWriter
from billing_pipeline.store import Store


@dataclass(frozen=True)
class BillingContext:
    store: Store
    writer: LedgerWriter | None  # None when the process serves analytics only
    internal_token: str
    admin_token: str


def context_of(request: Request) -> BillingContext:
    return request.app.state.billing


Context = Annotated[BillingContext, Depends(context_of)]
