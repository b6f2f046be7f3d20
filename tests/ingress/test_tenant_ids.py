"""Tenant ids match one pattern (schemas.checks.TENANT_ID_PATTERN) wherever they enter: the admin API, the
CLI, TenantAdmin, and the readers of `tenants`, which park a snapshot with a bad id instead of applying it.
Before this, any string was a tenant id (NUL, newlines, 10 kB), and the id becomes a Kafka key, a
Prometheus label, an HTTP header value and log text."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from http_api.openai_errors import answer_errors_in_openai_format
from ingress.admin.routes import AdminAccess, router
from ingress.tenancy.directory import TenantFollower
from ingress.tenancy.tenant_admin import InvalidTenantId, TenantAdmin
from schemas import checks, codec, topics
from tokenmill import cli
from tokenmill.commands import tenancy

# ids the tests and tools create (tests/integration/*, tokenmill/benchmarks/*) stay valid
VALID = ["acme", "a", "7", "viaapi", "after-dl-0123456789ab", "responses-other-1764748800", "sdk-node",
         "after-restarts-1764748800123456789", "gate-bench-3", "tenant_4", "team.eu-west", "x" * 64]
INVALID = ["", "-rf", ".hidden", "_x", "a b", "a\x00b", "a\nb", "a\rb", "tab\t", "a/b", "a:b", "a\"b", "é",
           "x" * 65, "x" * 10_000]
SECRET = b"tenant-id-test-secret"


@pytest.mark.parametrize("tenant_id", VALID)
def test_the_ids_in_use_match_the_pattern(tenant_id):
    assert checks.tenant_id_problem(tenant_id) is None


@pytest.mark.parametrize("tenant_id", INVALID + [None, 7])
def test_ids_that_could_break_a_key_label_header_or_log_line_are_refused(tenant_id):
    problem = checks.tenant_id_problem(tenant_id)
    assert problem is not None and "tenant id" in problem
    assert len(problem) < 300  # a 10 kB id is not echoed whole


def snapshot(tenant_id: str) -> tuple[bytes, list]:
    return codec.encode("TenantSnapshot", codec.new_event("TenantSnapshot", tenant_id=tenant_id))


@pytest.mark.parametrize("tenant_id", ["a\nb", "x" * 10_000, "a\x00b"])
def test_a_snapshot_with_a_bad_id_is_impossible(tenant_id):
    with pytest.raises(codec.UndecodableEvent, match="impossible.*tenant id"):
        codec.decode(*snapshot(tenant_id), check=True)


class Msg:
    """A `tenants` record as confluent_kafka hands it over."""

    def __init__(self, key: bytes, value: bytes, headers: list):
        self._key, self._value, self._headers = key, value, headers

    def key(self): return self._key
    def value(self): return self._value
    def headers(self): return self._headers
    def topic(self): return topics.TENANTS.name
    def partition(self): return 0
    def offset(self): return 5


class Parked(list):
    def send(self, msg, reason: str) -> None:
        self.append(reason)


@pytest.mark.parametrize("tenant_id", ["a\nb", "evil tenant", "x" * 10_000])
def test_the_tenant_view_parks_a_snapshot_whose_id_breaks_the_pattern(tenant_id):
    follower = TenantFollower(client_id="tenant-id-test")
    parked = Parked()
    follower.dead_letters.send = parked.send  # type: ignore[method-assign]
    follower._handle(Msg(tenant_id.encode(), *snapshot(tenant_id)))
    assert follower.directory.tenants == {}
    assert len(parked) == 1 and "impossible" in parked[0] and "tenant id" in parked[0]
    follower._handle(Msg(b"fine", *snapshot("fine")))  # and the view goes on
    assert list(follower.directory.tenants) == ["fine"]


@pytest.mark.parametrize("tenant_id", ["a\nb", "x" * 10_000])
def test_tenant_admin_refuses_a_bad_id_before_reading_or_writing_kafka(tenant_id, monkeypatch):
    def no_kafka(*_args, **_kwargs):
        raise AssertionError("reached Kafka with a bad tenant id")

    monkeypatch.setattr(TenantFollower, "catch_up", no_kafka)
    admin = TenantAdmin(SECRET)
    monkeypatch.setattr(admin, "_publish", no_kafka)
    with pytest.raises(InvalidTenantId, match="tenant id"):
        admin.upsert(tenant_id, name="x")
    with pytest.raises(InvalidTenantId):
        admin.issue_key(tenant_id)
    assert isinstance(InvalidTenantId("x"), ValueError)  # what callers that catch ValueError already handle


class RecordingAdmin:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def upsert(self, tenant_id, **changes):
        self.calls.append(("upsert", tenant_id))
        return {"tenant_id": tenant_id, **{f: None for f in ("name", "plan", "requests_per_minute",
                "tokens_per_minute", "max_concurrent", "monthly_token_budget", "allowed_models", "allowed_priorities",
                "fairness_weight", "default_deadline_s", "max_queued", "share_prefix_cache", "disabled")},
                "api_keys": []}

    def issue_key(self, tenant_id):
        self.calls.append(("issue_key", tenant_id))
        raise KeyError(tenant_id)


def admin_client() -> tuple[TestClient, RecordingAdmin]:
    app = FastAPI()
    access = AdminAccess(SECRET, token="admin-test-token")
    ops = RecordingAdmin()
    access._admin = ops  # type: ignore[assignment]
    app.state.admin = access
    app.state.context = SimpleNamespace(admission=SimpleNamespace(in_flight=lambda _tenant_id: (0, 0)))
    app.include_router(router)
    answer_errors_in_openai_format(app)
    client = TestClient(app, headers={"Authorization": "Bearer admin-test-token"})
    return client, ops


@pytest.mark.parametrize("path_id", ["a%0Ab", "a%00b", "evil%20tenant", "x" * 10_000, "-rf"])
def test_the_admin_api_answers_a_bad_id_with_a_400_naming_the_parameter(path_id):
    client, ops = admin_client()
    for r in (client.put(f"/admin/tenants/{path_id}", json={"name": "n"}),
              client.post(f"/admin/tenants/{path_id}/keys"),
              client.get(f"/admin/quota/{path_id}")):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tenant_id" and error["type"] == "invalid_request_error"
        assert error["code"] == "invalid_value" and "tenant id" in error["message"]
    assert ops.calls == []
    assert client.put("/admin/tenants/good-id", json={"name": "n"}).status_code == 200
    assert ops.calls == [("upsert", "good-id")]


@pytest.mark.parametrize("argv", [["tenants", "create", "a b"], ["tenants", "update", "x" * 100],
                                  ["keys", "issue", "a\nb"], ["keys", "list", "-"]])
def test_the_cli_refuses_a_bad_id_before_opening_any_client(argv, monkeypatch, capsys):
    def no_admin():
        raise AssertionError("made a Kafka client for a bad tenant id")

    monkeypatch.setattr(tenancy, "tenant_admin", no_admin)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "tenant id" in capsys.readouterr().err
