"""Batch input parsing, validation, id stability and result folding: no Kafka."""
from __future__ import annotations

import json
import threading

import pytest

from ingress.api.batches import ids
from ingress.api.batches.collect import BatchFold
from ingress.api.batches.parse import parse_file, parse_model_map
from ingress.api.batches.service import BatchRefused, BatchService
from ingress.api.batches.store import BatchStore
from ingress.api.batches.submit import build_request
from schemas import codec, topics

TENANT = {"tenant_id": "acme", "allowed_models": [], "allowed_priorities": ["interactive", "batch"],
          "share_prefix_cache": False}


class FakeModel:
    """One token per character; a 64-token context."""
    max_model_len = 64

    def chat_prompt(self, messages, tools=None):
        return [ord(c) % 100 for m in messages for c in m.text()]

    def text_prompt(self, prompt):
        return [ord(c) % 100 for c in prompt] if isinstance(prompt, str) else list(prompt)


def models(name):
    return FakeModel() if name == "tiny" else None


def line(custom_id, content="hi", url="/v1/chat/completions", method="POST", **body):
    if url == "/v1/completions":
        payload = {"model": "tiny", "prompt": content, "max_tokens": 2, **body}
    else:
        payload = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **body}
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": payload})


def as_file(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def test_valid_lines_are_prepared_in_order():
    parsed = parse_file(as_file(line("a"), line("b", url="/v1/completions", content="xyz")), models, tenant=TENANT)
    assert [(p.custom_id, p.chat, p.line, p.max_tokens) for p in parsed.lines] == [("a", True, 1, 2),
                                                                                 ("b", False, 2, 2)]
    assert parsed.lines[1].prompt_token_ids == [ord(c) % 100 for c in "xyz"]
    assert parsed.errors == [] and parsed.total_lines == 2


def test_each_bad_line_is_reported_and_the_rest_go_on():
    content = as_file(
        line("ok-1"),
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),
        line("ok-1"),                                   # duplicate custom_id
        line("m", method="GET"),
        line("u", url="/v1/embeddings"),
        json.dumps({"custom_id": "unknown-model", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "gpt-9", "prompt": "x"}}),
        line("long", content="x" * 63),                 # 63 prompt + 2 > 64
        line("badtemp", temperature=5),
        line("stream", stream=True),
        "",                                             # blank lines are skipped, not errors
        "[" * 100_000,                                  # nested past the parser's recursion limit
        line("ok-2"),
    )
    parsed = parse_file(content, models, tenant=TENANT)
    assert [p.custom_id for p in parsed.lines] == ["ok-1", "ok-2"]
    assert [(e.line, e.code) for e in parsed.errors] == [
        (2, "invalid_json"), (3, "missing_custom_id"), (4, "duplicate_custom_id"), (5, "invalid_method"),
        (6, "invalid_url"), (7, "model_not_found"), (8, "context_length_exceeded"), (9, "invalid_value"),
        (10, "unsupported_parameter"), (12, "invalid_json")]
    assert parsed.total_lines == 12
    assert parsed.errors[7].param == "temperature"


def test_model_map_and_allowed_models():
    content = as_file(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "gpt-4o-mini", "prompt": "x", "max_tokens": 1}}))
    parsed = parse_file(content, models, tenant=TENANT, model_map=parse_model_map("gpt-4o-mini=tiny"))
    assert parsed.lines[0].model == "tiny" and parsed.lines[0].requested_model == "gpt-4o-mini"
    restricted = {**TENANT, "allowed_models": ["other"]}
    parsed = parse_file(content, models, tenant=restricted, model_map={"gpt-4o-mini": "tiny"})
    assert [e.code for e in parsed.errors] == ["model_not_allowed"]
    with pytest.raises(ValueError):
        parse_model_map("nonsense")


def test_endpoint_of_an_http_batch_is_enforced():
    parsed = parse_file(as_file(line("a"), line("b", url="/v1/completions")), models, tenant=TENANT,
                        endpoint="/v1/chat/completions")
    assert [p.custom_id for p in parsed.lines] == ["a"]
    assert [e.code for e in parsed.errors] == ["mismatched_url"]


def test_ids_are_stable_and_scoped():
    content = as_file(line("a"))
    b1 = ids.batch_id("acme", content)
    assert b1 == ids.batch_id("acme", content) and b1.startswith("batch_")
    assert b1 != ids.batch_id("other", content)
    assert b1 != ids.batch_id("acme", content + b"\n" + line("b").encode())
    assert b1 != ids.batch_id("acme", content, {"gpt-4o": "tiny"})
    r = ids.request_id(b1, "a")
    assert r == ids.request_id(b1, "a") and len(r) == 32 and r != ids.request_id(b1, "b")
    assert ids.request_id(b1, "a") != ids.request_id(ids.batch_id("other", content), "a")
    assert 0 <= ids.result_partition(b1) < topics.BATCH_RESULTS.partitions
    assert ids.default_seed(b1, "a") == ids.default_seed(b1, "a") < 2**62
    assert ids.parse_window("24h") == 86400 and ids.parse_window("90m") == 5400
    with pytest.raises(ValueError):
        ids.parse_window("tomorrow")
    assert ids.parse_window("1d") == 86400
    for too_long in ("9999d", "25h", "86401s"):
        with pytest.raises(ValueError, match="at most 24h"):
            ids.parse_window(too_long)


def test_built_request_is_a_valid_batch_event():
    parsed = parse_file(as_file(line("a"), line("s", seed=7)), models, tenant=TENANT)
    bid = ids.batch_id("acme", b"x")
    recs = [build_request(p, batch_id=bid, tenant=TENANT, api_key_id="k", reply_partition=3, arrived_at_ms=1000,
                          deadline_ms=2000) for p in parsed.lines]
    rec = codec.decode(*codec.encode("InferenceRequested", recs[0])).record
    assert rec["priority"] == "batch" and rec["batch_id"] == bid and rec["custom_id"] == "a"
    assert rec["reply_topic"] == "batch-results" and rec["reply_partition"] == 3
    assert rec["request_id"] == ids.request_id(bid, "a") and rec["deadline_ms"] == 2000
    assert rec["sampling"]["seed"] == ids.default_seed(bid, "a")
    assert recs[1]["sampling"]["seed"] == 7
    assert rec["cache_salt"] == "acme"


def test_a_line_naming_the_tenants_adapter_runs_on_it_and_another_tenants_is_not_found():
    from lora import adapters as adapter_records

    catalog = adapter_records.AdapterCatalog()
    manifest, _ = adapter_records.new_records(tenant_id="acme", name="support", base_model="tiny",
                                              adapter_config="{}", weights=b"w", rank=8, target_modules=["q_proj"])
    catalog.apply_manifest(manifest["adapter_id"], manifest)
    content = as_file(line("a", model="tiny:support"), line("b", model="tiny:nope"), line("c"))
    parsed = parse_file(content, models, tenant=TENANT, adapters=catalog.resolve)
    [on_adapter, plain] = parsed.lines
    assert on_adapter.model == "tiny:support" and on_adapter.base_model == "tiny"
    assert on_adapter.adapter == {"adapter_id": "acme/support", "name": "support", "version": manifest["version"]}
    assert plain.adapter is None and [(e.custom_id, e.code) for e in parsed.errors] == [("b", "model_not_found")]
    rec = build_request(on_adapter, batch_id="batch_x", tenant=TENANT, api_key_id=None, reply_partition=0,
                        arrived_at_ms=1, deadline_ms=2)
    rec = codec.decode(*codec.encode("InferenceRequested", rec)).record
    assert rec["model"] == "tiny" and rec["adapter"] == on_adapter.adapter
    other = parse_file(content, models, tenant={**TENANT, "tenant_id": "globex"}, adapters=catalog.resolve)
    assert [(e.custom_id, e.code) for e in other.errors] == [("a", "model_not_found"), ("b", "model_not_found")]
    # allowed_models: the base model allows its tenant's adapters, as on the HTTP path
    restricted = parse_file(content, models, tenant={**TENANT, "allowed_models": ["tiny"]}, adapters=catalog.resolve)
    assert [p.custom_id for p in restricted.lines] == ["a", "c"]


def _service(tmp_path, published):
    svc = BatchService(BatchStore(tmp_path), models)

    def fake_publish(records, producer=None, **_):
        published.extend(records)
        return len(records)

    import ingress.api.batches.service as service_module
    return svc, service_module, fake_publish


def test_submit_is_idempotent_and_writes_manifest_and_errors(tmp_path, monkeypatch):
    published: list = []
    svc, module, fake = _service(tmp_path, published)
    monkeypatch.setattr(module, "publish", fake)
    content = as_file(line("a"), "garbage", line("b"))
    manifest, fresh = svc.submit(content, TENANT, "key1")
    assert fresh and manifest["state"] == "published" and manifest["invalid"] == 1
    assert [r["custom_id"] for r in manifest["requests"]] == ["a", "b"]
    assert len(published) == 2
    assert [e["line"] for e in svc.store.read_errors(manifest["batch_id"])] == [2]
    again, fresh = svc.submit(content, TENANT, "key1")
    assert not fresh and again["batch_id"] == manifest["batch_id"] and len(published) == 2
    # a crash between manifest and publish leaves "publishing": the next submit publishes again, same ids
    svc.store.update(manifest["batch_id"], state="publishing")
    third, fresh = svc.submit(content, TENANT, "key1")
    assert fresh and [r["request_id"] for r in published[2:]] == [r["request_id"] for r in published[:2]]
    assert third["created_at_ms"] == manifest["created_at_ms"]


def test_submit_needs_the_batch_priority(tmp_path):
    svc = BatchService(BatchStore(tmp_path), models)
    with pytest.raises(BatchRefused):
        svc.submit(as_file(line("a")), {**TENANT, "allowed_priorities": ["interactive"]}, "k")


def _manifest(reqs, **extra):
    return {"batch_id": "batch_x", "created_at_ms": 0, "deadline_ms": 10**13, "invalid": 0, "reply_partition": 0,
            "requests": [{"line": i + 1, "custom_id": c, "request_id": r, "chat": True, "model": "tiny", "n": 1,
                          "prompt_tokens": 3} for i, (c, r) in enumerate(reqs)], **extra}


def _item(rid, first, tokens, text, finish=None):
    return {"request_id": rid, "choice_index": 0, "first_token_index": first, "token_ids": tokens, "text": text,
            "logprobs": None, "finish_reason": finish,
            "usage": {"prompt_tokens": 3, "completion_tokens": first + len(tokens), "cached_tokens": 0}
            if finish else None}


def test_fold_dedups_replays_and_orders_output_by_line():
    fold = BatchFold(_manifest([("a", "r1"), ("b", "r2"), ("c", "r3")]))
    ev = lambda items: codec.Event("ReplyBatch", {"items": items, "timestamp_ms": 5000})
    fold.apply(ev([_item("r2", 0, [1], "x"), _item("r1", 0, [4], "p"), _item("other", 0, [9], "z")]))
    fold.apply(ev([_item("r2", 0, [1], "x"), _item("r2", 1, [2], "y", "length")]))   # replay of index 0
    fold.apply(ev([_item("r1", 1, [5], "q", "stop")]))
    fold.apply(codec.Event("RequestError", {"request_id": "r3", "status_code": 503, "error_type": "service_unavailable",
                                            "code": "deadline_exceeded", "message": "late", "timestamp_ms": 6000}))
    assert fold.done() and fold.counts()["completed"] == 2 and fold.counts()["failed"] == 1
    rows = fold.output_rows()
    assert [r["custom_id"] for r in rows] == ["a", "b"]
    body = rows[1]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == "xy" and body["usage"]["completion_tokens"] == 2
    assert body["id"] == "chatcmpl-r2" and rows[1]["response"]["status_code"] == 200
    errors = fold.error_rows([{"line": 9, "custom_id": None, "code": "invalid_json", "message": "bad"}])
    assert [e["custom_id"] for e in errors] == ["c", None]
    assert errors[0]["response"]["status_code"] == 503
    assert errors[0]["response"]["body"]["error"]["code"] == "deadline_exceeded"


def test_fold_counts_cancelled_requests_from_usage():
    fold = BatchFold(_manifest([("a", "r1"), ("b", "r2")], cancel_requested_at_ms=1))
    fold.apply(codec.Event("ReplyBatch", {"items": [_item("r1", 0, [1], "x", "stop")], "timestamp_ms": 1}))
    assert not fold.done() and fold.unfinished() == ["r2"]
    fold.apply(codec.Event("RequestCompleted", {"request_id": "r2", "batch_id": "batch_x", "status": "cancelled"}))
    assert fold.done() and fold.counts()["cancelled"] == 1
    assert fold.error_rows([])[0]["error"]["code"] == "batch_cancelled"


def test_real_tokenizer_gives_the_same_prompt_as_ingress(tiny_model_dir):
    from ingress.serving.served_model import ServedModel
    from infra.config import ModelSpec

    served = ServedModel(ModelSpec("tiny", tiny_model_dir))
    parsed = parse_file(as_file(line("a", content="Hello there"), line("b", url="/v1/completions", content="def f(")),
                        lambda name: served if name == "tiny" else None, tenant=TENANT)
    assert not parsed.errors
    from ingress.protocol import ChatMessage
    assert parsed.lines[0].prompt_token_ids == served.chat_prompt([ChatMessage(role="user", content="Hello there")])
    assert parsed.lines[1].prompt_token_ids == served.text_prompt("def f(")


def test_a_batch_is_bounded_in_requests_and_a_tenant_in_open_batches(tmp_path, monkeypatch):
    published: list = []
    svc, module, fake = _service(tmp_path, published)
    monkeypatch.setattr(module, "publish", fake)
    monkeypatch.setattr(module, "MAX_BATCH_LINES", 3)
    monkeypatch.setattr(module, "MAX_OPEN_BATCHES", 2)
    with pytest.raises(BatchRefused) as too_big:
        svc.submit(as_file(*(line(f"l{i}") for i in range(4))), TENANT, "k")
    assert (too_big.value.status, too_big.value.code) == (400, "too_many_requests") and published == []
    first, _ = svc.submit(as_file(line("a")), TENANT, "k")
    svc.submit(as_file(line("b")), TENANT, "k")
    with pytest.raises(BatchRefused) as too_many:
        svc.submit(as_file(line("c")), TENANT, "k")
    assert (too_many.value.status, too_many.value.code) == (429, "too_many_open_batches")
    assert svc.submit(as_file(line("a")), TENANT, "k")[0]["batch_id"] == first["batch_id"]  # resubmits still answer
    svc.store.update(first["batch_id"], final={"status": "completed"})
    assert svc.submit(as_file(line("c")), TENANT, "k")[1]  # one ended: room again
    other = {**TENANT, "tenant_id": "globex"}
    assert svc.submit(as_file(line("a")), other, "k")[1]  # another tenant has its own count


def test_one_tenants_submit_in_progress_does_not_hold_up_another_tenants(tmp_path, monkeypatch):
    published: list = []
    svc, module, fake = _service(tmp_path, published)
    inside, release = threading.Event(), threading.Event()

    def slow_for_acme(records, producer=None, **kw):
        if records[0]["tenant_id"] == "acme":
            inside.set()
            assert release.wait(10)
        return fake(records, producer, **kw)

    monkeypatch.setattr(module, "publish", slow_for_acme)
    acme = threading.Thread(target=svc.submit, args=(as_file(line("a")), TENANT, "k"))
    acme.start()
    try:
        assert inside.wait(10)  # acme's submit is mid-publish, holding its lock
        other = {**TENANT, "tenant_id": "globex"}
        assert svc.submit(as_file(line("g")), other, "k")[1]  # answered while acme's is still in progress
        assert [r["tenant_id"] for r in published] == ["globex"]
    finally:
        release.set()
        acme.join(10)
    assert sorted(r["tenant_id"] for r in published) == ["acme", "globex"]


def test_a_tenant_lists_its_own_batches_from_its_index(tmp_path, monkeypatch):
    published: list = []
    svc, module, fake = _service(tmp_path, published)
    monkeypatch.setattr(module, "publish", fake)
    mine, _ = svc.submit(as_file(line("a")), TENANT, "k")
    theirs, _ = svc.submit(as_file(line("a")), {**TENANT, "tenant_id": "globex"}, "k")
    reads: list = []
    real_read = type(tmp_path).read_text

    def spy(path, *a, **k):
        reads.append(path.parent.name)
        return real_read(path, *a, **k)

    monkeypatch.setattr(type(tmp_path), "read_text", spy)
    assert [m["batch_id"] for m in svc.store.list_batches("acme")] == [mine["batch_id"]]
    assert theirs["batch_id"] not in reads  # another tenant's manifest is not even opened
