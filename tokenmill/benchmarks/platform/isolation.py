"""`tokenmill bench isolation`: a victim tenant's chat latency while an attacker uses the new surfaces.

    tokenmill bench isolation [--victim 40] [--victim-every-s 0.25] [--attacker-rpm 600]
        [--attacks reads,grammar,stored,uploads] [--model-size tiny] [--json PATH]

On a private stack (its own KRaft broker, chDB directory and ports, as `bench control-plane` starts it),
tenant `victim` streams ``--victim`` chat completions of 8 tokens, one every ``--victim-every-s``, and its
time to first token is measured at the client: first alone, then while tenant `attacker`, whose plan
allows ``--attacker-rpm`` requests a minute, runs one of issue 33's attacks as fast as its quota lets it:

* **reads**: loops of `GET /v1/responses/{id}` and held `?stream=true` replays of its background responses
  (item 1: reads used to cost no quota and held the request threads);
* **grammar**: structured-output requests whose JSON schema holds a pattern that compiles for tens of
  seconds, each one slightly different so no cache helps (item 2);
* **stored**: stored responses with the largest input the model takes and metadata at its caps (item 4).
* **uploads**: adapter registrations of 64 MiB through the admin API, from UPLOAD_CONCURRENCY loops at once
  (issue 56, item 3: the upload's JSON, surrogate check and base64 ran on the event loop every tenant's
  requests share; at most 8 are taken at once, so the ninth loop's answers are 429s). The weights are a
  well-formed safetensors header over 64 MiB of zeros under a tensor name no adapter has: every upload is read
  in full and then refused (400), so each costs what a real one does up to its tensor check, and nothing is
  stored that the next phase would carry.

Each attack runs as its own attacker tenant (`attacker-<attack>`), so each starts with a whole minute of
quota. Reported per phase: the victim's TTFT p50/p99, its failed requests, p99 over the first alone phase's
p99 (target <= 1.2, none failed), and what the attacker got: answers by status and error code (429s are its
quota working, 400s a refused request). The alone phase runs again at the end, so the table shows how much
the machine itself drifts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

from infra.config import RANDOM_MODEL_NAME, local_worker_threads
from infra.paths import local_dir
from tokenmill.benchmarks.harness import report as bench_report
from tokenmill.benchmarks.harness.report import percentile, table
from tokenmill.benchmarks.harness.stack import ADMIN_TOKEN, SECRET, PrivateStack
from tokenmill.benchmarks.harness.waiting import wait_live

ATTACKS = ("reads", "grammar", "stored", "uploads")
ATTACK_CONCURRENCY = 8
UPLOAD_CONCURRENCY = 9  # one more than the admin API takes at once
UPLOAD_BYTES = 64 * 2**20
# A pattern whose nested bounded repetitions xgrammar expands for tens of seconds (issue 33 measured 37.6 s
# for {1,8}); the property name varies per request so that no compiled grammar is reused.
SLOW_PATTERN = "^(([a-z]{1,8}){1,8}){1,8}$"


async def _victim_ttfts(client, key: str, model: str, n: int, every_s: float) -> tuple[list[float], list[str]]:
    async def one(i: int):
        sent = time.monotonic()
        body = {"model": model, "messages": [{"role": "user", "content": f"victim question {i}"}],
                "max_tokens": 8, "stream": True, "ignore_eos": True}
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                if r.status_code != 200:
                    return None, f"{r.status_code} {(await r.aread()).decode()[:120]}"
                first = None
                async for line in r.aiter_lines():  # read to its end: the request holds its slot until then
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return None, chunk["error"].get("message", "error")
                        if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                            first = time.monotonic() - sent
                return (first, None) if first is not None else (None, "no token")
        except Exception as exc:  # noqa: BLE001 - a failure of the victim is what is counted
            return None, repr(exc)[:120]

    tasks = []
    t0 = time.monotonic()
    for i in range(n):
        await asyncio.sleep(max(0.0, t0 + i * every_s - time.monotonic()))
        tasks.append(asyncio.create_task(one(i)))
    results = await asyncio.gather(*tasks)
    return [t for t, _ in results if t is not None], [e for _, e in results if e is not None]


def _upload_body(model: str) -> bytes:
    """A registration whose weights are a safetensors file of 64 MiB that no base model's adapter can be."""
    import base64
    import struct

    header = json.dumps({"not.a.lora.weight": {"dtype": "F32", "shape": [UPLOAD_BYTES // 4],
                                                "data_offsets": [0, UPLOAD_BYTES]}}).encode()
    weights = struct.pack("<Q", len(header)) + header + bytes(UPLOAD_BYTES)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    return json.dumps({"name": "upload", "base_model": model, "adapter_config": config,
                       "weights": base64.b64encode(weights).decode()}).encode()


async def _uploads(admin_port: int, tenant: str, model: str, stop: asyncio.Event, outcomes: Counter[str]) -> None:
    import httpx

    body = _upload_body(model)
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}", timeout=120) as admin:
        async def loop() -> None:
            while not stop.is_set():
                try:
                    r = await admin.post(f"/admin/tenants/{tenant}/adapters", content=body, headers=headers)
                    outcomes[f"upload {r.status_code}"] += 1
                    if r.status_code == 429:
                        await asyncio.sleep(float(r.headers.get("retry-after") or 1))
                except Exception as exc:  # noqa: BLE001 - the attacker's failures are not measured
                    outcomes[f"error {type(exc).__name__}"] += 1
                    await asyncio.sleep(0.2)

        await asyncio.gather(*(loop() for _ in range(UPLOAD_CONCURRENCY)))


async def _attack(kind: str, client, key: str, model: str, stop: asyncio.Event, outcomes: Counter[str]) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    ids: list[str] = []
    if kind == "reads":
        for i in range(4):
            r = await client.post("/v1/responses", headers=auth, json={
                "model": model, "input": f"attacker {i}", "max_output_tokens": 64, "background": True})
            outcomes[f"create {r.status_code}"] += 1
            if r.status_code == 200:
                ids.append(r.json()["id"])
        if not ids:
            return

    async def loop(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                if kind == "reads":
                    rid = ids[n % len(ids)]
                    if worker % 2:
                        async with client.stream("GET", f"/v1/responses/{rid}?stream=true", headers=auth) as r:
                            outcomes[f"replay {r.status_code}"] += 1
                            async for _ in r.aiter_lines():
                                if stop.is_set():
                                    break
                    else:
                        r = await client.get(f"/v1/responses/{rid}", headers=auth)
                        outcomes[f"get {r.status_code}"] += 1
                elif kind == "grammar":
                    schema = {"type": "object", "properties": {f"p{worker}_{n}": {"type": "string",
                                                                                 "pattern": SLOW_PATTERN}},
                              "required": [f"p{worker}_{n}"]}
                    r = await client.post("/v1/chat/completions", headers=auth, json={
                        "model": model, "messages": [{"role": "user", "content": "fill it"}], "max_tokens": 8,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
                    outcomes[f"structured {r.status_code}"] += 1
                else:
                    r = await client.post("/v1/responses", headers=auth, json={
                        "model": model, "input": " ".join(f"word{j}" for j in range(250)), "max_output_tokens": 1,
                        "metadata": {f"k{j:02d}{'x' * 60}": "v" * 512 for j in range(16)}})
                    outcomes[f"stored {r.status_code}"] += 1
                if r.status_code in (400, 429):
                    try:
                        outcomes[f"  {r.status_code} {r.json()['error'].get('code')}"] += 1
                    except Exception:  # noqa: BLE001 - a stream's status only
                        pass
                if r.status_code == 429:
                    await asyncio.sleep(min(5.0, float(r.headers.get("retry-after") or 1)))
            except Exception as exc:  # noqa: BLE001 - the attacker's failures are not measured
                outcomes[f"error {type(exc).__name__}"] += 1
                await asyncio.sleep(0.2)

    await asyncio.gather(*(loop(w) for w in range(ATTACK_CONCURRENCY)))


async def _phase(port: int, model: str, victim_key: str, attacker_key: str, attack: str | None, args,
                 admin_port: int = 0) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits) as client:
        stop, outcomes = asyncio.Event(), Counter[str]()
        if attack == "uploads":
            attacking = asyncio.create_task(_uploads(admin_port, "attacker-uploads", model, stop, outcomes))
        elif attack:
            attacking = asyncio.create_task(_attack(attack, client, attacker_key, model, stop, outcomes))
        else:
            attacking = None
        if attacking is not None:
            await asyncio.sleep(3.0)  # the attack under way before the victim's first request
        ttfts, failures = await _victim_ttfts(client, victim_key, model, args.victim, args.victim_every_s)
        stop.set()
        if attacking is not None:
            try:
                await asyncio.wait_for(attacking, 30)
            except asyncio.TimeoutError:
                attacking.cancel()
    return {"phase": attack or "alone", "victim_ttft_p50_s": percentile(ttfts, 50),
            "victim_ttft_p99_s": percentile(ttfts, 99), "victim_ok": len(ttfts), "victim_failed": len(failures),
            "victim_errors": failures[:5], "attacker": dict(outcomes)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="tokenmill bench isolation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--victim", type=int, default=40)
    ap.add_argument("--victim-every-s", type=float, default=0.25)
    ap.add_argument("--attacker-rpm", type=int, default=600)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--model-size", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--json", default=str(local_dir() / "bench" / "isolation.json"))
    args = ap.parse_args(argv)
    attacks = [a for a in args.attacks.split(",") if a]
    if not set(attacks) <= set(ATTACKS):
        ap.error(f"--attacks takes {','.join(ATTACKS)}")

    from tokenmill.stack.processes import exit_cleanly_on_termination
    from ingress.tenancy.tenant_admin import TenantAdmin

    exit_cleanly_on_termination()
    stack = PrivateStack(Path(tempfile.mkdtemp(prefix="tokenmill-isolation-")), model_name=RANDOM_MODEL_NAME)
    rows: list[dict] = []
    print(f"starting a private stack in {stack.work} ...", flush=True)
    try:
        stack.start(local_worker_threads(), model_size=args.model_size, kv_cache_mb=128)
        victim_key = stack.tenant_key("victim", 10, 60)
        admin = TenantAdmin(SECRET.encode())
        attacker_keys = {}
        for attack in attacks:  # one attacker tenant per attack: each starts with its whole minute of quota
            admin.upsert(f"attacker-{attack}", name=f"attacker-{attack}", requests_per_minute=args.attacker_rpm,
                         tokens_per_minute=200_000, max_concurrent=32)
            attacker_keys[attack] = admin.issue_key(f"attacker-{attack}").key
        for key in (victim_key, *attacker_keys.values()):
            wait_live(stack.port, stack.model_name, key)
        asyncio.run(_phase(stack.port, stack.model_name, victim_key, "", None, args))  # warm-up
        for attack in [None, *attacks, None]:
            row = asyncio.run(_phase(stack.port, stack.model_name, victim_key, attacker_keys.get(attack, ""),
                                     attack, args, stack.admin_port))
            rows.append(row)
            print(f"{row['phase']:<8} victim TTFT p99 {row['victim_ttft_p99_s']} s, failed {row['victim_failed']}, "
                  f"attacker {row['attacker']}", flush=True)
    finally:
        stack.stop()
    alone = rows[0]["victim_ttft_p99_s"] or float("nan")
    for row in rows:
        row["p99_over_alone"] = (row["victim_ttft_p99_s"] or float("nan")) / alone
    machine = bench_report.machine()
    print(f"\nvictim: {args.victim} chat completions of 8 tokens, one every {args.victim_every_s:g} s; attacker at "
          f"{args.attacker_rpm} requests/min, {ATTACK_CONCURRENCY} concurrent loops; one worker "
          f"({args.model_size} model), streams, ingress, billing and one KRaft broker on {machine['cpus']} cores\n")
    for line in table(rows, [("phase", -8, "phase", ""), ("TTFT p50 s", 11, "victim_ttft_p50_s", ".3f"),
                             ("TTFT p99 s", 11, "victim_ttft_p99_s", ".3f"), ("p99/alone", 10, "p99_over_alone", ".2f"),
                             ("failed", 7, "victim_failed", "d"),
                             ("attacker answers", -40, lambda r: ", ".join(f"{k}: {v}" for k, v in
                                                                          sorted(r["attacker"].items())), "")]):
        print(line)
    result = {"machine": machine, "config": vars(args), "phases": rows}
    bench_report.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
