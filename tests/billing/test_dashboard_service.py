"""The dashboard's routes on the billing service, over real chDB: sign-in, and series that match
the ledger for the window and tenants asked."""
from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from billing_events import completed
from billing_pipeline.dashboard.live import LiveSources
from billing_pipeline.dashboard.login import login_url
from billing_pipeline.service import create_app
from test_service import load

ADMIN = "admin-secret"
HOUR_MS = 3_600_000


@pytest.fixture()
def client(store):
    now = int(time.time() * 1000)
    load(store, [completed(f"a-{i}", "alice", prompt=100, completion=10, finished_at_ms=now - 60_000, ttft=float(i))
                 for i in range(5)]
         + [completed(f"b-{i}", "bob", model="m-large", prompt=7, completion=3, finished_at_ms=now - 60_000)
            for i in range(3)]
         + [completed("b-old", "bob", prompt=1000, completion=1000, finished_at_ms=now - 5 * HOUR_MS)]
         + [completed("a-gone", "alice", status="cancelled", prompt=2, completion=1, finished_at_ms=now - 60_000)])
    app = create_app(store, None, internal="internal", admin=ADMIN, live_sources=LiveSources(None, [], None))
    # plain HTTP on loopback, as `make up` serves it: the one place the cookie is not Secure
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c


def sign_in(client) -> None:
    url = login_url("http://127.0.0.1", ADMIN)
    r = client.get(url, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/dashboard"
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/dashboard" in cookie
    assert "secure" not in cookie


def test_the_cookie_is_secure_unless_served_over_plain_http_on_loopback(store):
    app = create_app(store, None, internal="internal", admin=ADMIN, live_sources=LiveSources(None, [], None))
    for base, secure in (("http://billing.example", True),  # behind a TLS-terminating proxy
                         ("https://billing.example", True), ("http://localhost", False)):
        with TestClient(app, base_url=base) as c:
            r = c.get(login_url(base, ADMIN), follow_redirects=False)
            assert r.status_code == 303
            assert ("secure" in r.headers["set-cookie"].lower().split("; ")) is secure, (base, r.headers["set-cookie"])



def test_the_cookie_is_secure_behind_a_local_proxy_that_passes_a_loopback_host_on(store, monkeypatch):
    app = create_app(store, None, internal="internal", admin=ADMIN, live_sources=LiveSources(None, [], None))
    base = "http://127.0.0.1"
    with TestClient(app, base_url=base) as c:
        forwarded = c.get(login_url(base, ADMIN), headers={"X-Forwarded-For": "203.0.113.7"}, follow_redirects=False)
        assert "secure" in forwarded.headers["set-cookie"].lower().split("; ")
        monkeypatch.setenv("TOKENMILL_DASHBOARD_SECURE_COOKIE", "1")  # a proxy that forwards no header
        forced = c.get(login_url(base, ADMIN), follow_redirects=False)
        assert "secure" in forced.headers["set-cookie"].lower().split("; ")


def test_a_login_link_is_good_once_across_billing_processes_and_restarts(store):
    """Two apps on one store stand for two billing processes (or one before and after a restart):
    each keeps its own memory of used links, and the store's record is what they share."""
    first = create_app(store, None, internal="internal", admin=ADMIN, live_sources=LiveSources(None, [], None))
    second = create_app(store, None, internal="internal", admin=ADMIN, live_sources=LiveSources(None, [], None))
    url = login_url("http://127.0.0.1", ADMIN)
    with TestClient(first, base_url="http://127.0.0.1") as a, TestClient(second, base_url="http://127.0.0.1") as b:
        assert a.get(url, follow_redirects=False).status_code == 303
        assert b.get(url, follow_redirects=False).status_code == 401
        assert b.get(login_url("http://127.0.0.1", ADMIN), follow_redirects=False).status_code == 303


def test_without_a_session_nothing_is_shown(client):
    assert client.get("/dashboard").status_code == 401
    assert client.get("/dashboard/api/usage").status_code == 401
    assert client.get("/dashboard/api/live").status_code == 401
    assert client.get("/dashboard/login", params={"token": "1.2.3"}).status_code == 401
    assert client.get("/dashboard/api/usage", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_a_signed_in_browser_gets_the_page_and_series_that_match_the_ledger(client):
    sign_in(client)
    page = client.get("/dashboard")
    assert page.status_code == 200 and "chart.umd.min.js" in page.text
    assert client.get("/dashboard/static/vendor/chart.umd.min.js").status_code == 200  # vendored, no CDN
    u = client.get("/dashboard/api/usage", params={"since": "1h"}).json()
    assert u["bucket_s"] == 60 and len(u["buckets"]) in (60, 61)
    assert {t: sum(v) for t, v in u["tokens_by_tenant"].items()} == {"alice": 5 * 110 + 3, "bob": 3 * 10}
    assert {m: sum(v) for m, v in u["tokens_by_model"].items()} == {"m-small": 553, "m-large": 30}
    assert sum(u["outcomes"]["finished"]) == 8 and sum(u["outcomes"]["cancelled"]) == 1
    assert max(v for v in u["latency"]["ttft_p99_ms"] if v is not None) == 20.0
    assert u["tenants"] == ["alice", "bob"]


def test_the_window_and_the_tenant_filter_narrow_the_series(client):
    headers = {"Authorization": f"Bearer {ADMIN}"}  # scripts may use the admin token instead of a cookie
    day = client.get("/dashboard/api/usage", params={"since": "24h"}, headers=headers).json()
    assert sum(day["tokens_by_tenant"]["bob"]) == 30 + 2000
    only_alice = client.get("/dashboard/api/usage", params={"since": "24h", "tenant": "alice"}, headers=headers).json()
    assert list(only_alice["tokens_by_tenant"]) == ["alice"]
    assert [t["tenant_id"] for t in only_alice["top_tenants"]] == ["alice"]
    assert only_alice["tenants"] == ["alice", "bob"]  # the filter still offers every tenant
    both = client.get("/dashboard/api/usage", params=[("since", "24h"), ("tenant", "alice"), ("tenant", "bob")],
                      headers=headers).json()
    assert set(both["tokens_by_tenant"]) == {"alice", "bob"}
    assert client.get("/dashboard/api/usage", params={"since": "yesterday-ish"}, headers=headers).status_code == 400
    assert client.get("/dashboard/api/usage", params={"since": "now"}, headers=headers).status_code == 400


def test_live_panel_reports_sources_that_do_not_answer(store):
    app = create_app(store, None, internal="internal", admin=ADMIN,
                     live_sources=LiveSources("http://127.0.0.1:9/metrics", [], None))
    with TestClient(app) as c:
        live = c.get("/dashboard/api/live", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert live["queue"] is None and len(live["errors"]) == 1 and "127.0.0.1:9" in live["errors"][0]
