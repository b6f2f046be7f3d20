"""The dashboard's HTTP routes on the billing service.

``/dashboard`` (the page) and ``/dashboard/api/*`` (its data) need the session cookie that
``/dashboard/login`` gives for a login token (billing_pipeline/dashboard/login.py); the API also
takes the admin token as a bearer, for scripts. The page and its charting library are files in
``static/``; the library is vendored there by `make install`, so the page loads nothing from
elsewhere.
"""
from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from billing_pipeline import analytics
from billing_pipeline.dashboard.context import Dashboard, DashboardContext
from billing_pipeline.dashboard.live import LiveSources, live_panel
from billing_pipeline.dashboard.login import SESSION_COOKIE, SESSION_TTL_S, LoginTokens
from billing_pipeline.dashboard.used_logins import StoredLoginNonces
from billing_pipeline.dashboard.panels import usage_panels
from billing_pipeline.store import Store
from http_api.bearer import bearer_token
from infra.config import same_secret
from infra import settings

STATIC_DIR = Path(__file__).with_name("static")
CHART_LIBRARY = STATIC_DIR / "vendor" / "chart.umd.min.js"
MAX_TENANTS_IN_FILTER = 200

_SIGN_IN = """<!doctype html><meta charset="utf-8"><title>tokenmill dashboard</title>
<body style="font-family: system-ui, sans-serif; margin: 3em"><h1>tokenmill dashboard</h1>
<p>{reason}</p><p>Run <code>tokenmill dashboard</code> on the machine that runs tokenmill: it prints (or opens)
a link that signs this browser in. A link works once, for two minutes.</p></body>"""


router = APIRouter()


def mount_dashboard(app, store: Store, admin: str, sources: LiveSources | None = None) -> None:
    tokens = LoginTokens(admin, used=StoredLoginNonces(store))
    app.state.dashboard = DashboardContext(store, admin, tokens, sources or LiveSources.from_env())
    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="dashboard-static")


def signed_in(request: Request, dashboard: DashboardContext) -> bool:
    if same_secret(bearer_token(request.headers.get("authorization")), dashboard.admin_token):
        return True
    return dashboard.tokens.session_valid(request.cookies.get(SESSION_COOKIE))


def require_session(request: Request, dashboard: DashboardContext) -> None:
    if not signed_in(request, dashboard):
        raise HTTPException(401, "dashboard session required: run `tokenmill dashboard`")


@router.get("/dashboard/login", include_in_schema=False)
def login(request: Request, dashboard: Dashboard, token: str = ""):
    tokens = dashboard.tokens
    if not tokens.redeem(token):
        return HTMLResponse(_SIGN_IN.format(reason="This sign-in link is not valid: it has expired, "
                                                   "was already used, or was not signed by this installation."),
                            status_code=401)
    # 303: the browser follows with a GET and drops the token from its address bar
    response = RedirectResponse("/dashboard", status_code=303)
    response.set_cookie(SESSION_COOKIE, tokens.new_session(), max_age=SESSION_TTL_S, httponly=True,
                        samesite="strict", secure=cookie_must_be_secure(request), path="/dashboard")
    return response


LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host")


def cookie_must_be_secure(request: Request) -> bool:
    """Secure unless the page is served over plain HTTP on loopback (where a browser would drop a
    Secure cookie). Behind a TLS-terminating proxy the service sees plain HTTP on a routable name,
    and the cookie stays Secure so the browser never sends it over an unencrypted hop. A proxy on the
    same machine may pass a loopback Host on (nginx's default for `proxy_pass http://127.0.0.1:...`):
    a request carrying a forwarding header is a proxied one, and TOKENMILL_DASHBOARD_SECURE_COOKIE=1
    makes the cookie Secure whatever the request says (for a local proxy that adds none)."""
    if settings.DASHBOARD_SECURE_COOKIE.get():
        return True
    if any(h in request.headers for h in FORWARDING_HEADERS):
        return True
    return not (request.url.scheme == "http" and (request.url.hostname or "") in LOOPBACK_HOSTS)


@router.get("/dashboard", include_in_schema=False)
def page(request: Request, dashboard: Dashboard):
    if not signed_in(request, dashboard):
        return HTMLResponse(_SIGN_IN.format(reason="This browser is not signed in."), status_code=401)
    if not CHART_LIBRARY.exists():
        return HTMLResponse(_SIGN_IN.format(reason="The charting library is missing from this install: run "
                                                   "<code>make install</code>."), status_code=503)
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})


@router.get("/dashboard/api/usage", include_in_schema=False)
def usage(request: Request, dashboard: Dashboard, since: str = "1h", until: str | None = None,
          tenant: list[str] = Query(default_factory=list)) -> dict:
    require_session(request, dashboard)
    now_ms = int(time.time() * 1000)
    try:
        since_ms = analytics.parse_time(since, now_ms)
        until_ms = analytics.parse_time(until, now_ms) or now_ms
    except ValueError as exc:
        raise HTTPException(400, f"bad time: {exc}") from None
    if since_ms is None or since_ms >= until_ms:
        raise HTTPException(400, "since must be before until")
    store, width, tenants = dashboard.store, analytics.bucket_width_s(since_ms, until_ms), tenant or None
    out = usage_panels(analytics.usage_over_time(store, width, since_ms, until_ms, tenants),
                       analytics.latency_over_time(store, width, since_ms, until_ms, tenants),
                       since_ms, until_ms, width)
    out["tenants"] = analytics.tenants_in_window(store, since_ms, until_ms)[:MAX_TENANTS_IN_FILTER]
    out["selected_tenants"] = tenant
    return out


@router.get("/dashboard/api/live", include_in_schema=False)
def live(request: Request, dashboard: Dashboard) -> dict:
    require_session(request, dashboard)
    return live_panel(dashboard.sources)
