"""`tokenmill bench billing`: ledger ingest rate, Kafka -> ClickHouse, in one process.

Produces N RequestCompleted events to a throwaway topic (never the real `usage` topic, which a
running billing service would bill), then times one LedgerWriter until all N are in the ledger
(a fresh chDB directory unless --clickhouse-url). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from infra.paths import local_dir


def run(n: int, batch_max: int, tenants: int, clickhouse_url: str | None, bootstrap: str | None) -> dict:
    import os

    from confluent_kafka.admin import AdminClient, NewTopic

    if bootstrap:
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    from billing_pipeline import migrations
    from billing_pipeline.store import Store
    from infra.kafka import clients as kafka_clients

    tmp = None
    if clickhouse_url is None:
        tmp = tempfile.mkdtemp(prefix="tokenmill-bench-chdb-")
        clickhouse_url = f"chdb://{tmp}"
    store = Store(clickhouse_url, f"bench_{uuid.uuid4().hex[:8]}")
    migrations.migrate(store)
    topic = f"usage-bench-{uuid.uuid4().hex[:8]}"
    admin = AdminClient(kafka_clients.admin_config())
    factor, replicated = kafka_clients.replication_for(admin)
    admin.create_topics([NewTopic(topic, num_partitions=12, replication_factor=factor,
                                  config=replicated)])[topic].result()
    try:
        produce_s = _produce(topic, n, tenants)
        writer, ingest_s, steady_s = _ingest(store, topic, n, batch_max)
        rows = store.scalar("SELECT count() FROM {db}.ledger FINAL")
        agg = store.scalar("SELECT sum(requests) FROM {db}.usage_minute FINAL")
        return {"events": n, "batch_max": batch_max, "tenants": tenants, "produce_s": round(produce_s, 3),
                "produce_events_per_s": round(n / produce_s), "ingest_s": round(ingest_s, 3),
                "ingest_events_per_s": round(n / ingest_s),
                "ingest_events_per_s_after_first_fetch": round(n / steady_s),
                "batches": writer.stats.batches, "ledger_rows": int(rows), "aggregate_requests": int(agg),
                "clickhouse": "chdb (embedded)" if clickhouse_url.startswith("chdb://") else "server"}
    finally:
        admin.delete_topics([topic])
        store.command("DROP DATABASE IF EXISTS {db}")
        store.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _produce(topic: str, n: int, tenants: int) -> float:
    """N RequestCompleted events over `tenants` tenants; the seconds it took, flush included."""
    from confluent_kafka import Producer

    from infra.kafka import clients as kafka_clients
    from schemas import codec

    producer = Producer(kafka_clients.producer_config("bench-billing", **{"linger.ms": 20,
                                                                         "batch.num.messages": 10000}))
    now = int(time.time() * 1000)
    t0 = time.perf_counter()
    for i in range(n):
        tenant = f"tenant-{i % tenants}"
        rec = codec.new_event("RequestCompleted", request_id=f"req-{i}", tenant_id=tenant,
                              model=("m-small", "m-large")[i % 2], status="finished", prompt_tokens=100 + i % 50,
                              completion_tokens=20 + i % 30, cached_tokens=i % 40, arrived_at_ms=now - 2000,
                              started_at_ms=now - 1500, first_token_at_ms=now - 1200,
                              finished_at_ms=now - (n - i) % 600_000, ttft_ms=800.0, tpot_ms=20.0, queue_ms=500.0)
        kafka_clients.produce_event(producer, topic, tenant, "RequestCompleted", rec)
        if i % 10000 == 0:
            producer.poll(0)
    producer.flush(120)
    return time.perf_counter() - t0


def _ingest(store, topic: str, n: int, batch_max: int):
    """One LedgerWriter until all N are in the ledger: the (closed) writer, the seconds from its start
    and the seconds from its first fetched batch."""
    from billing_pipeline.consumer import LedgerWriter

    writer = LedgerWriter(store, group_id=f"bench-{uuid.uuid4().hex[:8]}", topic=topic, batch_max=batch_max)
    writer.open()
    t1 = time.perf_counter()
    first_row_at = None
    while True:
        messages = writer.poll_batch()
        if messages:
            first_row_at = first_row_at or time.perf_counter()
            writer.write(messages)
        if writer.stats.inserted >= n:
            break
        if time.perf_counter() - t1 > 600:
            raise TimeoutError("bench did not finish in 10 minutes")
    ingest_s = time.perf_counter() - t1
    steady_s = time.perf_counter() - (first_row_at or t1)
    writer.close()
    return writer, ingest_s, steady_s


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="tokenmill bench billing")
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--batch-max", type=int, default=5000)
    p.add_argument("--tenants", type=int, default=50)
    p.add_argument("--clickhouse-url", default=None, help="default: a fresh temporary chDB directory")
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default $KAFKA_BOOTSTRAP_SERVERS)")
    p.add_argument("--start-broker", action="store_true", help="start a temporary local Kafka broker")
    p.add_argument("--json", "--out", dest="out", default=str(local_dir() / "bench" / "billing.json"),
                   help="write the results here (--out: its former name)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    broker = None
    bootstrap = args.bootstrap
    if args.start_broker:
        import socket

        from tokenmill.stack.kafka_broker import LocalKafka

        def free():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]
        broker = LocalKafka(Path(tempfile.mkdtemp(prefix="tokenmill-bench-kafka-")), port=free(),
                            controller_port=free())
        bootstrap = broker.start()
    try:
        result = run(args.events, args.batch_max, args.tenants, args.clickhouse_url, bootstrap)
    finally:
        if broker is not None:
            broker.stop()
    width = max(len(k) for k in result)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in result.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
