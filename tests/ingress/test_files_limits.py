"""Files bounded per tenant (issue 33, item 4): a per-tenant bytes quota, expiry (`expires_after`, as OpenAI's
files API), a listing that reads the tenant's own files only, and batch metadata within OpenAI's caps."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from http_api.openai_errors import answer_errors_in_openai_format
from ingress.api.batches.routes import router
from ingress.api.batches.service import BatchService
from ingress.api.batches.store import BatchStore
from ingress.tenancy.admission import EdgeAdmission
from ingress.tenancy.directory import Caller

UNLIMITED = {"requests_per_minute": 0, "tokens_per_minute": 0, "max_concurrent": 0, "monthly_token_budget": 0}


class Keys:
    """Bearer `<tenant>` is that tenant."""

    def caller(self, headers) -> Caller:
        tenant_id = headers["authorization"].removeprefix("Bearer ")
        return Caller(tenant={"tenant_id": tenant_id, **UNLIMITED}, key_id="k")


@pytest.fixture
def api(tmp_path):
    app = FastAPI()
    answer_errors_in_openai_format(app)
    app.state.context = SimpleNamespace(authenticator=Keys(), admission=EdgeAdmission())
    app.state.batches = BatchService(BatchStore(tmp_path))
    app.include_router(router)
    return TestClient(app)


def upload(api, tenant: str, size: int, **form):
    return api.post("/v1/files", headers={"Authorization": f"Bearer {tenant}"},
                    files={"file": ("in.jsonl", b"x" * size)}, data={"purpose": "batch", **form})


def test_a_tenant_past_its_files_quota_is_refused_and_another_is_not(api, monkeypatch):
    monkeypatch.setenv("TOKENMILL_FILES_BYTES_PER_TENANT", "1000")
    assert upload(api, "attacker", 600).status_code == 200
    refused = upload(api, "attacker", 600)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "files_quota_exceeded"
    assert upload(api, "victim", 600).status_code == 200
    first = api.get("/v1/files", headers={"Authorization": "Bearer attacker"}).json()["data"][0]["id"]
    assert api.delete(f"/v1/files/{first}", headers={"Authorization": "Bearer attacker"}).status_code == 200
    assert upload(api, "attacker", 600).status_code == 200  # a deletion frees its bytes


def test_a_file_expires_as_expires_after_says_and_a_batch_file_after_30_days(api):
    default = upload(api, "acme", 10).json()
    assert default["expires_at"] - default["created_at"] == 30 * 86400
    hour = upload(api, "acme", 10, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"})
    assert hour.status_code == 200 and hour.json()["expires_at"] - hour.json()["created_at"] == 3600
    for bad in ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
                {"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
                {"expires_after[anchor]": "created_at", "expires_after[seconds]": str(31 * 86400)}):
        refused = upload(api, "acme", 10, **bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("expires_after"), bad


def test_an_expired_file_is_gone_from_every_route_and_from_disk(tmp_path):
    store = BatchStore(tmp_path)
    gone = store.put_file("acme", "old.jsonl", "batch", b"{}", expires_at=int(time.time()) - 1)
    kept = store.put_file("acme", "new.jsonl", "batch", b"{}", expires_at=int(time.time()) + 3600)
    assert [m["id"] for m in store.list_files("acme")] == [kept["id"]]
    assert store.file_meta(gone["id"]) is None and not (tmp_path / "files" / gone["id"]).exists()
    assert store.file_bytes("acme") == 2


def test_listing_a_tenants_files_reads_its_own_metadata_only(tmp_path):
    store = BatchStore(tmp_path)
    mine = store.put_file("acme", "a.jsonl", "batch", b"a")
    theirs = [store.put_file("other", f"{i}.jsonl", "batch", b"b") for i in range(3)]
    for meta in theirs:  # unreadable if anyone parsed them
        (tmp_path / "files" / meta["id"] / "meta.json").write_text("not json")
    assert [m["id"] for m in store.list_files("acme")] == [mine["id"]]


def test_files_stored_before_the_index_are_indexed_once(tmp_path):
    old = tmp_path / "files" / "file-old"
    old.mkdir(parents=True)
    (old / "content").write_bytes(b"{}")
    (old / "meta.json").write_text(json.dumps({"id": "file-old", "object": "file", "bytes": 2, "created_at": 1,
                                               "filename": "o", "purpose": "batch", "status": "processed",
                                               "status_details": None, "tenant_id": "acme"}))
    assert [m["id"] for m in BatchStore(tmp_path).list_files("acme")] == ["file-old"]


@pytest.mark.parametrize("metadata, says", [
    ({f"k{i}": "v" for i in range(17)}, "17 pairs"), ({"k" * 65: "v"}, "keys"), ({"k": "v" * 513}, "values")])
def test_batch_metadata_past_openais_caps_is_a_400(api, metadata, says):
    file_id = upload(api, "acme", 0).json()["id"]
    r = api.post("/v1/batches", headers={"Authorization": "Bearer acme"}, json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
        "metadata": metadata})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata" and says in r.json()["error"]["message"]
