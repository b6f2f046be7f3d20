"""The billing HTTP service: tenant isolation, admin auth, and answers that match the ledger."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from billing_events import completed
from billing_pipeline import ledger, pricing
from billing_pipeline.pricing import PriceBook
from billing_pipeline.service import create_app

INTERNAL = "internal-secret"
ADMIN = "admin-secret"


def load(store, events):
    rows = [ledger.ledger_row(e, PriceBook.load(store)) for e in events]
    ledger.insert_rows(store, rows)
    ledger.refresh_buckets(store, ledger.buckets_of(rows))


@pytest.fixture()
def client(store):
    load(store, [completed(f"a-{i}", "alice", prompt=100, completion=10) for i in range(5)]
         + [completed(f"b-{i}", "bob", model="m-large", prompt=7, completion=3) for i in range(3)])
    with TestClient(create_app(store, None, internal=INTERNAL, admin=ADMIN)) as c:
        yield c


def as_tenant(tenant, token=INTERNAL):
    return {"x-tokenmill-tenant": tenant, "x-tokenmill-internal-token": token}


def test_a_tenant_sees_only_its_own_usage(client):
    alice = client.get("/v1/usage", headers=as_tenant("alice"), params={"bucket": "hour"})
    assert alice.status_code == 200
    body = alice.json()
    assert body["tenant_id"] == "alice"
    assert body["total"]["requests"] == 5 and body["total"]["tokens"] == 550
    assert {r["model"] for r in body["by_model"]} == {"m-small"}
    assert sum(p["tokens"] for p in body["series"]) == 550

    bob = client.get("/v1/usage/month-to-date", headers=as_tenant("bob")).json()
    assert bob["tenant_id"] == "bob" and bob["tokens"] == 30


def test_a_tenant_cannot_read_another_tenant(client):
    # naming another tenant in the query is refused
    r = client.get("/v1/usage", headers=as_tenant("alice"), params={"tenant_id": "bob"})
    assert r.status_code == 403
    r = client.get("/v1/usage/month-to-date", headers=as_tenant("alice"), params={"tenant": "bob"})
    assert r.status_code == 403
    # a forged tenant header without the internal token is refused
    assert client.get("/v1/usage", headers={"x-tokenmill-tenant": "bob"}).status_code == 401
    assert client.get("/v1/usage", headers=as_tenant("bob", token="guess")).status_code == 401
    # no tenant header, no data
    assert client.get("/v1/usage", headers={"x-tokenmill-internal-token": INTERNAL}).status_code == 401
    # a tenant with no usage gets zeros, never someone else's rows
    eve = client.get("/v1/usage", headers=as_tenant("eve")).json()
    assert eve["total"]["tokens"] == 0 and eve["by_model"] == [] and eve["series"] == []
    # and tenant credentials do not open admin endpoints
    assert client.get("/admin/usage/top-tenants", headers=as_tenant("alice")).status_code == 401


@pytest.mark.parametrize("path", ["/admin/usage/top-tenants", "/admin/usage/models", "/admin/usage/latency",
                                  "/admin/usage/month-to-date", "/admin/usage/tenants/alice",
                                  "/admin/usage/summary", "/admin/ledger/requests", "/admin/prices"])
def test_admin_endpoints_need_the_admin_token(client, path):
    assert client.get(path).status_code == 401
    assert client.get(path, headers={"authorization": "Bearer wrong"}).status_code == 401
    assert client.get(path, headers={"x-tokenmill-admin-token": INTERNAL}).status_code == 401
    assert client.get(path, headers={"authorization": "Bearer t\u00f6ken".encode()}).status_code == 401
    assert client.get(path, headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200


def test_admin_queries_across_tenants(client):
    h = {"authorization": f"Bearer {ADMIN}"}
    top = client.get("/admin/usage/top-tenants", headers=h).json()
    assert [(t["tenant_id"], t["tokens"]) for t in top] == [("alice", 550), ("bob", 30)]
    models = {m["model"]: m["tokens"] for m in client.get("/admin/usage/models", headers=h).json()}
    assert models == {"m-small": 550, "m-large": 30}
    lat = client.get("/admin/usage/latency", headers=h).json()
    assert {m["model"] for m in lat} == {"m-small", "m-large"}
    assert all(m["ttft_p50_ms"] == 20.0 and m["tpot_p99_ms"] == 5.0 for m in lat)
    mtd = client.get("/admin/usage/month-to-date", headers=h).json()
    assert mtd["alice"]["tokens"] == 550 and mtd["bob"]["tokens"] == 30
    found = client.post("/admin/ledger/lookup", headers=h, json={"request_ids": ["a-1", "nope"]}).json()
    assert [r["request_id"] for r in found] == ["a-1"]
    assert client.put("/admin/prices", headers=h,
                      json={"model": "m-small", "token_kind": "output", "usd_per_mtok": 2}).status_code == 200
    assert client.put("/admin/prices", headers=h,
                      json={"model": "m-small", "token_kind": "bogus", "usd_per_mtok": 2}).status_code == 400


def test_cost_uses_the_price_in_effect_at_the_event_time(store):
    t_change = 1_800_000_000_000
    pricing.set_price(store, "m-small", "input", "1.0", 0)
    pricing.set_price(store, "m-small", "cached_input", "0.25", 0)
    pricing.set_price(store, "m-small", "output", "4", 0)
    pricing.set_price(store, "m-small", "output", "8", t_change)  # output price doubles at t_change
    pricing.set_price(store, "*", "output", "100", 0)  # default for models without a price
    before = completed("r-before", "carol", prompt=1000, cached=400, completion=100, finished_at_ms=t_change - 1)
    after = completed("r-after", "carol", prompt=1000, cached=400, completion=100, finished_at_ms=t_change)
    other = completed("r-other", "carol", model="m-unpriced", prompt=0, completion=10, finished_at_ms=t_change)
    shed = completed("r-shed", "carol", status="shed", prompt=1000, completion=0, finished_at_ms=t_change)
    load(store, [before, after, other, shed])
    cost = dict(store.rows("SELECT request_id, cost_pusd FROM {db}.ledger FINAL"))
    # pico-USD: tokens x USD/Mtok x 1e6
    assert cost["r-before"] == 600 * 1_000_000 + 400 * 250_000 + 100 * 4_000_000
    assert cost["r-after"] == 600 * 1_000_000 + 400 * 250_000 + 100 * 8_000_000
    assert cost["r-other"] == 10 * 100_000_000
    assert cost["r-shed"] == 0
    agg = store.scalar("SELECT toInt64(sum(cost_pusd)) FROM {db}.usage_minute FINAL WHERE tenant_id = 'carol'")
    assert agg == cost["r-before"] + cost["r-after"] + cost["r-other"]


def test_errors_answer_in_the_openai_format_as_ingress_does(client):
    """Ingress forwards billing's answers to `GET /v1/usage` as they are: an error reads like every other."""
    cases = [(client.get("/admin/prices"), 401), (client.get("/v1/usage", headers=as_tenant("alice"),
                                                             params={"since": "not a time"}), 400),
             (client.get("/no/such/path"), 404),
             (client.get("/admin/usage/top-tenants", params={"limit": 0},
                         headers={"authorization": f"bearer {ADMIN}"}), 400)]
    for answer, status in cases:
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
