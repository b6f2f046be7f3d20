"""What the dashboard's routes work with, made once by `mount_dashboard` and reached by a route through
the typed `Dashboard` dependency (the app's state)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from billing_pipeline.dashboard.live import LiveSources
from billing_pipeline.dashboard.login import LoginTokens
from billing_pipeline.store import Store


@dataclass(frozen=True)
class DashboardContext:
    store: Store
    admin_token: str
    tokens: LoginTokens  # sign-in links and the sessions they open
    sources: LiveSources  # where the live panel reads the queue and the workers


def dashboard_of(request: Request) -> DashboardContext:
    return request.app.state.dashboard


Dashboard = Annotated[DashboardContext, Depends(dashboard_of)]
