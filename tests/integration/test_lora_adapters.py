"""Tenants' LoRA adapters end to end on the real model (issue 34's tests that must hold), through the
official openai SDK against the real stack: two tenants register an adapter each through the admin API;
each gets its adapter's greedy answer (PEFT's, token for token as text) and the other's adapter id is a 404
(chat, models.retrieve, models.list); the ledger bills each request under its adapter exactly what was
streamed; a deleted adapter is a 404 at once; a registration the engine would refuse is a 400 naming the
field, and nothing is stored; a worker killed mid-stream on an adapter request gives the undisturbed text."""
from __future__ import annotations

import base64
import json
import signal
import uuid

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from schemas import topics
from tests.ingress.adapter_files import write_adapter
from tests.integration.conftest import ADMIN_TOKEN, REAL_MODEL
from tests.integration.faults import stream_completion
from tests.integration.kafka_probe import wait_for_events
from tests.integration.processes import Service
from tests.support.ledger import ledger_rows
from tests.support.peft_reference import peft_greedy_each

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

QUESTION = "Write a haiku about the sea."
MAX_NEW = 16
# tenant -> (adapter name, seed): two different random adapters, each owned by one tenant
# (a suffix per run: the fault test runs in a pytest run of its own, maybe on the same broker)
RUN = uuid.uuid4().hex[:6]
NORTH, SOUTH = f"lora-north-{RUN}", f"lora-south-{RUN}"
TENANTS = {NORTH: ("support", 1), SOUTH: ("legal", 2)}


@pytest.fixture(scope="module")
def lora_worker(stack, real_model_dir):
    worker = Service("worker-lora", [
        "serve", "worker", "--model", str(real_model_dir), "--model-name", REAL_MODEL,
        "--worker-id", "test-worker-lora", "--threads", "1", "--kv-cache-mb", "128", "--max-loras", "2"],
        {**stack.env, "TOKENMILL_GRAMMAR_WARM": "0"},  # sent no structured-output request
        stack.services["worker"].log_path.parent).start()
    try:
        worker.wait_log("assigned work partitions", timeout=300)  # 0.5 GB of float32 weights on 2 busy cores
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def adapter_dirs(real_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenant-adapters")
    return {tenant: write_adapter(root / name, real_model_dir, rank=8, seed=seed, scale=0.06)
            for tenant, (name, seed) in TENANTS.items()}


def _register(stack, tenant: str, name: str, directory, **override) -> httpx.Response:
    body = {"name": name, "base_model": REAL_MODEL,
            "adapter_config": json.loads((directory / "adapter_config.json").read_text()),
            "weights": base64.b64encode((directory / "adapter_model.safetensors").read_bytes()).decode(), **override}
    return httpx.post(f"{stack.admin_url}/admin/tenants/{tenant}/adapters", json=body,
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)


def _listed(stack, tenant: str) -> list[str]:
    answer = httpx.get(f"{stack.admin_url}/admin/tenants/{tenant}/adapters",
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    answer.raise_for_status()
    return [a["id"] for a in answer.json()["data"]]


@pytest.fixture(scope="module")
def clients(stack, lora_worker, adapter_dirs):
    out = {}
    for tenant, (name, _) in TENANTS.items():
        key = stack.issue_tenant(tenant)
        answer = _register(stack, tenant, name, adapter_dirs[tenant])
        assert answer.status_code == 200, answer.text
        assert answer.json()["id"] == f"{REAL_MODEL}:{name}"
        out[tenant] = openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=180)
    return out


@pytest.fixture(scope="module")
def reference(real_model_dir, adapter_dirs) -> dict[str | None, str]:
    """PEFT's greedy answer to QUESTION with each tenant's adapter, and the base model's (None)."""
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    refs = peft_greedy_each(str(real_model_dir), {tenant: str(adapter_dirs[tenant]) if tenant else None
                                                  for tenant in [None, *TENANTS]}, [prompt], MAX_NEW, stop_at_eos=True)
    return {tenant: tokenizer.decode(tokens, skip_special_tokens=True) for tenant, [tokens] in refs.items()}


def _streamed(client, model: str) -> tuple[str, str, openai.types.CompletionUsage]:
    text, usage, request_id = "", None, None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                                temperature=0, max_tokens=MAX_NEW, stream=True,
                                                stream_options={"include_usage": True}):
        request_id = chunk.id.removeprefix("chatcmpl-")
        usage = chunk.usage or usage
        text += "".join(choice.delta.content or "" for choice in chunk.choices)
    return request_id, text, usage


def test_each_tenant_gets_its_adapters_answer_billed_under_it_and_the_others_id_is_404(stack, clients, reference):
    for tenant in TENANTS:  # the adapters change the answer, so equality below is the adapter's doing
        assert reference[tenant] != reference[None], tenant
    assert reference[NORTH] != reference[SOUTH]
    streamed = {}
    for tenant, (name, _) in TENANTS.items():
        client, model = clients[tenant], f"{REAL_MODEL}:{name}"
        whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                               temperature=0, max_tokens=MAX_NEW)
        assert whole.choices[0].message.content == reference[tenant], tenant
        assert whole.model == model
        request_id, text, usage = _streamed(client, model)
        assert text == reference[tenant]
        streamed[request_id] = (tenant, name, usage)
        assert model in [m.id for m in client.models.list()]
        assert client.models.retrieve(model).id == model
    base = clients[NORTH].chat.completions.create(
        model=REAL_MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=MAX_NEW)
    assert base.choices[0].message.content == reference[None]  # the base model is untouched beside them

    north, south = clients[NORTH], clients[SOUTH]
    for client, foreign in ((north, f"{REAL_MODEL}:legal"), (south, f"{REAL_MODEL}:support")):
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=foreign, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(foreign)
        assert foreign not in [m.id for m in client.models.list()]

    rows = {row["request_id"]: row for row in ledger_rows(stack.billing_url, streamed)}
    assert set(rows) == set(streamed)
    for request_id, (tenant, name, usage) in streamed.items():
        row = rows[request_id]
        assert (row["tenant_id"], row["model"], row["adapter"]) == (tenant, REAL_MODEL, name)
        assert (row["prompt_tokens"], row["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)


def test_a_batch_line_naming_the_tenants_adapter_runs_on_it_and_is_billed_on_its_line(stack, clients, reference):
    """As a vLLM user would expect: `<base>:<adapter>` in a batch line runs on the tenant's adapter (PEFT's
    answer), beside a base-model line of the same file; another tenant's adapter is that line's 404."""
    import time

    from ingress.api.batches import ids

    def line(custom_id: str, model: str) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": model, "messages": [{"role": "user", "content": QUESTION}],
                                    "temperature": 0, "max_tokens": MAX_NEW}})

    client = clients[SOUTH]
    content = "\n".join([line("on-adapter", f"{REAL_MODEL}:legal"), line("base", REAL_MODEL),
                         line("foreign", f"{REAL_MODEL}:support")]) + "\n"
    uploaded = client.files.create(file=("lora.jsonl", content.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    output = {o["custom_id"]: o["response"]["body"]
              for o in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    assert output["on-adapter"]["choices"][0]["message"]["content"] == reference[SOUTH]
    assert output["on-adapter"]["model"] == f"{REAL_MODEL}:legal"
    assert output["base"]["choices"][0]["message"]["content"] == reference[None]
    errors = [json.loads(e)["error"] for e in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["line"], e["code"]) for e in errors] == [(3, "model_not_found")]
    request_ids = {ids.request_id(batch.id, c): c for c in ("on-adapter", "base")}
    rows = {row["request_id"]: row for row in ledger_rows(stack.billing_url, request_ids)}
    assert {request_ids[r]: (row["model"], row["adapter"]) for r, row in rows.items()} == {
        "on-adapter": (REAL_MODEL, "legal"), "base": (REAL_MODEL, "")}


def test_a_registration_the_engine_would_refuse_is_a_400_naming_the_field_and_stores_nothing(stack, clients,
                                                                                           adapter_dirs):
    before = _listed(stack, NORTH)
    directory = adapter_dirs[NORTH]
    config = json.loads((directory / "adapter_config.json").read_text())
    from safetensors.torch import load, save

    tensors = load((directory / "adapter_model.safetensors").read_bytes())
    huge_name = sorted(k for k in tensors if "lora_B" in k)[0]
    huge = save({k: (v * 0 + 3e38 if k == huge_name else v).contiguous() for k, v in tensors.items()})
    cases = [  # (the param the 400 names, the registration's changes, what its message must say)
        ("adapter_config.target_modules", {"adapter_config": {**config, "target_modules": ["q_proj", "lm_head"]}}, ""),
        ("adapter_config.r", {"adapter_config": {**config, "r": 512}}, ""),
        # hostile values: they would reach other tenants' tokens in a shared batch (issue 56)
        ("adapter_config.lora_alpha", {"adapter_config": {**config, "lora_alpha": 1e300}}, "over the bound of 1024"),
        ("weights", {"weights": base64.b64encode(huge).decode()}, huge_name),
        ("base_model", {"base_model": "no-such-model"}, ""),
        ("weights", {"weights": base64.b64encode(b"not a safetensors file").decode()}, ""),
        ("name", {"name": "support"}, ""),  # the tenant's own name again: a clash
    ]
    for param, override, message in cases:
        answer = _register(stack, NORTH, override.pop("name", "other"), directory, **override)
        assert answer.status_code == 400, (param, answer.text)
        assert answer.json()["error"]["param"] == param, answer.text
        assert message in answer.json()["error"]["message"], answer.text
    assert _listed(stack, NORTH) == before


@pytest.mark.faults
def test_a_worker_sigkilled_mid_stream_on_an_adapter_request_gives_the_undisturbed_text(stack, lora_worker,
                                                                                         clients):
    """Sampled with a seed: the restarted worker fetches the adapter again and regenerates the request from
    its seed, and the client gets exactly the text an undisturbed run gives, billed once."""
    key = clients[SOUTH].api_key
    body = {"model": f"{REAL_MODEL}:legal", "prompt": "Once upon a time, in a small village by the sea,",
            "max_tokens": 32, "temperature": 0.8, "seed": 99, "ignore_eos": True}
    _, undisturbed, _ = stream_completion(stack, body, key=key)
    killed = []

    def kill_and_restart(request_id, tokens):
        if tokens == 8 and not killed:
            lora_worker.kill(signal.SIGKILL)
            killed.append(request_id)
            lora_worker.start()  # the same worker id: its partitions come back, the request is redelivered

    request_id, text, finish = stream_completion(stack, body, on_token=kill_and_restart, key=key)
    assert killed == [request_id]
    assert text == undisturbed and finish == "length"
    billed = wait_for_events(topics.USAGE.name, lambda e: e.record["request_id"] == request_id, count=2, timeout=8)
    assert [(e.record["completion_tokens"], e.record["adapter"]) for e in billed] == [(32, "legal")]


def test_a_ninth_concurrent_upload_is_a_429_before_its_body_is_read(stack, clients):
    """Eight uploads whose bodies are still arriving hold every place; the ninth is refused at once, and once
    the eight end (here each a 400: the body lacks fields) the next upload is taken again."""
    import threading
    import time

    url = f"{stack.admin_url}/admin/tenants/{NORTH}/adapters"
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    release = threading.Event()
    answers: list[int] = []

    def slow_body():
        yield b'{"name": "slow", '
        release.wait(120)
        yield b'"base_model": "nope"}'

    def upload():
        answers.append(httpx.post(url, content=slow_body(), headers=auth, timeout=180).status_code)

    uploads = [threading.Thread(target=upload) for _ in range(8)]
    for t in uploads:
        t.start()
    incomplete = {"name": "quick", "base_model": REAL_MODEL}  # refused at once (400) while places are free
    deadline = time.monotonic() + 60
    while True:  # until the server holds all eight (each took its place before reading its body)
        ninth = httpx.post(url, json=incomplete, headers=auth, timeout=30)
        if ninth.status_code == 429:
            break
        assert ninth.status_code == 400 and time.monotonic() < deadline, ninth.text
    assert ninth.json()["error"]["code"] == "too_many_uploads" and ninth.headers.get("retry-after")
    release.set()
    for t in uploads:
        t.join(60)
    assert answers == [400] * 8
    after = httpx.post(url, json=incomplete, headers=auth, timeout=30)
    assert after.status_code == 400 and after.json()["error"]["code"] == "missing_required_parameter", after.text


def test_orphan_chunks_are_swept_and_a_restarted_worker_holds_none(stack, clients):
    """Chunks of a registration whose manifest never came, on the real topic: a worker's view started after
    them keeps none of their bytes; the sweep tombstones them and no later view sees their keys; live
    adapters keep theirs."""
    from lora import adapters

    manifest, chunks = adapters.new_records(tenant_id=NORTH, name=f"orphan-{RUN}", base_model=REAL_MODEL,
                                            adapter_config="{}", weights=b"half a registration" * 1000, rank=8,
                                            target_modules=["q_proj"], chunk_bytes=4096)
    publisher = adapters.AdapterPublisher("orphan-test")
    try:
        publisher._send([(f"{c['adapter_id']}@{c['version']}#{c['index']}", "AdapterChunk", c) for c in chunks],
                        publisher._partition(manifest["adapter_id"]))  # chunks, and then no manifest
    finally:
        publisher.close()
    orphan_keys = {f"{c['adapter_id']}@{c['version']}#{c['index']}" for c in chunks}

    def fresh_view() -> adapters.AdapterCatalog:  # what a worker holds once started: AdapterCache.start
        follower = adapters.AdapterFollower(f"orphan-view-{uuid.uuid4().hex[:6]}", keep_chunks=True,
                                            dead_letters=False)
        follower.start(30)
        follower.stop()
        return follower.catalog

    before = fresh_view()
    assert orphan_keys <= set(before.chunk_keys)  # on the topic...
    assert (manifest["adapter_id"], manifest["version"]) not in before.chunks  # ...but not in the worker's memory
    live = [m for m in before.manifests.values() if m["tenant_id"] in TENANTS]
    assert live and all(before.weights(m) is not None for m in live)
    answer = httpx.post(f"{stack.admin_url}/admin/adapters/sweep", json={"grace_s": 0},
                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)
    assert answer.status_code == 200 and answer.json()["tombstoned_chunks"] >= len(chunks), answer.text
    after = fresh_view()
    assert not orphan_keys & set(after.chunk_keys)
    assert all(after.weights(m) is not None for m in live)  # live adapters keep every chunk


def test_a_deleted_adapter_is_404_for_new_requests_at_once(stack, clients):
    answer = httpx.delete(f"{stack.admin_url}/admin/tenants/{NORTH}/adapters/support",
                          headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    assert answer.status_code == 200 and answer.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        clients[NORTH].chat.completions.create(model=f"{REAL_MODEL}:support",
                                                      messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert f"{REAL_MODEL}:support" not in _listed(stack, NORTH)
