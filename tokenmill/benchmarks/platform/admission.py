"""`tokenmill bench admission`: how fast one ingress process says no.

Starts one real ingress process (against a real broker), makes a tenant that is over its
quota, and fires requests at it over keep-alive connections from a lean asyncio HTTP
client. Reports rejections per second and rejection latency percentiles for two cases:
a tenant at its concurrency limit (refused before the prompt is tokenized) and a request
larger than the tenant's token limit (refused after tokenizing).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from tokenmill.benchmarks.harness import report
from tokenmill.benchmarks.harness.report import percentile

from infra.paths import local_dir


async def _connection(port: int, request: bytes, deadline: float, latencies: list[float], statuses: dict):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline:
            began = time.perf_counter()
            writer.write(request)
            # every request here should be refused at once; one that is admitted would wait for a worker
            status_line = await asyncio.wait_for(reader.readline(), timeout=10)
            length = 0
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - began)
            code = int(status_line.split()[1])
            statuses[code] = statuses.get(code, 0) + 1
    finally:
        writer.close()


def _hold_one_request(port: int, request: bytes):
    """Send a request that is admitted and then waits (no worker runs), keeping its connection open
    so it stays in flight and the tenant stays at its concurrency limit."""
    import socket

    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(request)
    time.sleep(0.5)
    return conn


def _request(key: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: " + str(len(payload)).encode() +
            b"\r\n\r\n" + payload)


async def _load(port: int, request: bytes, seconds: float, connections: int) -> dict:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    began = time.perf_counter()
    deadline = began + seconds
    await asyncio.gather(*[_connection(port, request, deadline, latencies, statuses) for _ in range(connections)])
    elapsed = time.perf_counter() - began
    lat = latencies

    def pct(q):
        p = percentile(lat, q)
        return None if p is None else p * 1000

    return {"requests": len(lat), "seconds": elapsed, "per_s": len(lat) / elapsed, "statuses": statuses,
            "p50_ms": pct(50), "p99_ms": pct(99), "mean_ms": statistics.fmean(lat) * 1000 if lat else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tokenmill bench admission", description=__doc__)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", default="4,32", help="comma-separated keep-alive connection counts")
    ap.add_argument("--start-broker", action="store_true", help="start a throwaway local broker")
    ap.add_argument("--json", default=str(local_dir() / "bench" / "admission.json"))
    args = ap.parse_args(argv)

    from gpu_consumers.default_model import build_default_model
    from infra.kafka import clients as kafka_clients
    from tokenmill.stack.kafka_broker import LocalKafka
    from ingress.tenancy.tenant_admin import TenantAdmin
    from tokenmill.stack.processes import Service, exit_cleanly_on_termination, free_port

    exit_cleanly_on_termination()
    work = Path(tempfile.mkdtemp(prefix="tokenmill-admission-"))
    broker = None
    if args.start_broker or not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        broker = LocalKafka(work / "kafka", port=free_port(), controller_port=free_port())
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = broker.start()
    kafka_clients.create_topics()
    model = build_default_model(local_dir() / "models" / "tiny", size="tiny")
    secret = "bench-admission-secret"
    os.environ["TOKENMILL_KEY_SECRET"] = secret
    port = free_port()
    env = {"TOKENMILL_KEY_SECRET": secret, "TOKENMILL_MODELS": f"tiny={model}",
           "KAFKA_BOOTSTRAP_SERVERS": os.environ["KAFKA_BOOTSTRAP_SERVERS"]}
    ingress = Service("ingress", ["serve", "ingress", "--port", str(port), "--reply-partition", "15",
                                           "--admin-port", str(free_port())], env, work)
    ingress.start()
    results = {}
    try:
        ingress.wait_http(f"http://127.0.0.1:{port}/health")
        admin = TenantAdmin(secret.encode())
        # Limits that refuse every request whatever the minute window: one request held in flight
        # against max_concurrent=1, and a token limit smaller than any single request.
        admin.upsert("bench-rpm", max_concurrent=1, default_deadline_s=3600)
        rpm_key = admin.issue_key("bench-rpm").key
        admin.upsert("bench-tpm", tokens_per_minute=1)
        tpm_key = admin.issue_key("bench-tpm").key
        time.sleep(1.5)  # every ingress picks tenants up within a second
        body = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog. " * 8, "max_tokens": 16}
        held = _hold_one_request(port, _request(rpm_key, body))
        for name, key in (("at its concurrency limit (refused before tokenizing)", rpm_key),
                          ("over tokens/min (refused after tokenizing)", tpm_key)):
            asyncio.run(_load(port, _request(key, body), 1.0, 4))  # warm up
            for connections in (int(c) for c in args.connections.split(",")):
                results[f"{name}, {connections} conns"] = asyncio.run(
                    _load(port, _request(key, body), args.seconds, connections))
        held.close()
    finally:
        ingress.stop()
        if broker:
            broker.stop()
    print(f"\nadmission benchmark: one ingress process, keep-alive connections, {args.seconds:.0f} s per row, "
          f"load generator on the same machine ({os.cpu_count()} cores)\n")
    print(f"{'case':<58} {'rejections/s':>12} {'p50 ms':>8} {'p99 ms':>8}  statuses")
    for name, r in results.items():
        print(f"{name:<58} {r['per_s']:>12.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}  {r['statuses']}")
    report.write_json(args.json, {"machine": report.machine(), "connections": args.connections, "results": results})


if __name__ == "__main__":
    main()
