"""Versioned schema migrations, applied in order when the billing process starts.

Each migration is a list of idempotent statements (``IF NOT EXISTS``), so a crash in
the middle of one is repaired by running it again; its version is recorded in
``schema_migrations`` only after all of its statements ran. Never edit a released
migration: append a new one.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from billing_pipeline.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "ledger", (
        # One row per request. Keyed (deduplicated) by request_id; tenant_id leads the sorting
        # key only to make tenant-scoped reads fast (a request belongs to exactly one tenant).
        # No PARTITION BY: ReplacingMergeTree collapses duplicates only inside a partition, and a
        # request completed twice (a worker retry) may straddle any time boundary.
        # `version` = finished_at in ms: of two different completions of one request the later
        # one wins; identical replays are identical rows, so any of them is the same.
        """
        CREATE TABLE IF NOT EXISTS {db}.ledger (
            request_id String,
            tenant_id LowCardinality(String),
            model LowCardinality(String),
            status LowCardinality(String),
            finish_reason LowCardinality(String),
            priority LowCardinality(String),
            billable UInt8,
            prompt_tokens UInt32,
            cached_tokens UInt32,
            input_tokens UInt32,
            completion_tokens UInt32,
            total_tokens UInt32,
            reserved_tokens Int64,
            arrived_at DateTime64(3, 'UTC'),
            started_at Nullable(DateTime64(3, 'UTC')),
            first_token_at Nullable(DateTime64(3, 'UTC')),
            finished_at DateTime64(3, 'UTC'),
            ttft_ms Nullable(Float64),
            tpot_ms Nullable(Float64),
            queue_ms Nullable(Float64),
            worker_id String,
            api_key_id String,
            batch_id String,
            priced UInt8,
            cost_input_pusd Int64,
            cost_cached_pusd Int64,
            cost_output_pusd Int64,
            cost_pusd Int64,
            event_id String,
            event_ts DateTime64(3, 'UTC'),
            kafka_partition Int32,
            kafka_offset Int64,
            ingested_at DateTime64(3, 'UTC'),
            version UInt64,
            INDEX finished_idx finished_at TYPE minmax GRANULARITY 1,
            INDEX request_bf request_id TYPE bloom_filter(0.01) GRANULARITY 1
        ) ENGINE = ReplacingMergeTree(version)
        ORDER BY (tenant_id, request_id)
        """,
    )),
    Migration(2, "prices", (
        # Price of one token kind of one model from `effective_from` on, in pico-USD per token
        # (= micro-USD per million tokens), so costs are exact integers. model '*' is the default.
        """
        CREATE TABLE IF NOT EXISTS {db}.prices (
            model LowCardinality(String),
            token_kind LowCardinality(String),
            effective_from DateTime64(3, 'UTC'),
            pusd_per_token UInt64,
            created_at DateTime64(3, 'UTC')
        ) ENGINE = ReplacingMergeTree(created_at)
        ORDER BY (model, token_kind, effective_from)
        """,
    )),
    Migration(3, "usage_minute", (
        # Per tenant/model/minute totals, recomputed by the ledger writer from the deduplicated
        # ledger (FINAL) for every bucket a batch touched, before it commits offsets. A recompute
        # replaces the bucket (ReplacingMergeTree on `version`), so it is exact under duplicates.
        """
        CREATE TABLE IF NOT EXISTS {db}.usage_minute (
            tenant_id LowCardinality(String),
            model LowCardinality(String),
            minute DateTime('UTC'),
            requests UInt64,
            billable_requests UInt64,
            finished UInt64,
            cancelled UInt64,
            failed UInt64,
            shed UInt64,
            prompt_tokens UInt64,
            cached_tokens UInt64,
            input_tokens UInt64,
            completion_tokens UInt64,
            total_tokens UInt64,
            cost_pusd Int128,
            version UInt64
        ) ENGINE = ReplacingMergeTree(version)
        ORDER BY (tenant_id, model, minute)
        """,
    )),
    Migration(4, "dashboard_logins", (
        # One row per redemption of a dashboard login link (billing_pipeline/dashboard/login.py): a
        # link is good once across every billing process and restart, so its nonce's uses are
        # counted here. Rows outlive their link's expiry by a day, then go.
        """
        CREATE TABLE IF NOT EXISTS {db}.dashboard_logins (
            nonce String,
            expires_at DateTime('UTC'),
            redemption String,
            redeemed_at DateTime64(3, 'UTC')
        ) ENGINE = MergeTree ORDER BY nonce
        TTL expires_at + INTERVAL 1 DAY
        """,
    )),
    Migration(5, "adapters", (
        # The LoRA adapter a request ran with (its name, the model id's suffix; '' = the base model). Rows
        # written before read as ''. The minute aggregate is keyed by it too (a new column may join the
        # sorting key in the ALTER that adds it), so each adapter has its own buckets; both statements
        # are no-ops when run again.
        "ALTER TABLE {db}.ledger ADD COLUMN IF NOT EXISTS adapter LowCardinality(String) AFTER model",
        "ALTER TABLE {db}.usage_minute ADD COLUMN IF NOT EXISTS adapter LowCardinality(String) AFTER model, "
        "MODIFY ORDER BY (tenant_id, model, minute, adapter)",
    )),
    Migration(6, "tenant_prices", (
        # A price may be one tenant's (an adapter's name is its tenant's: acme's `support` is not globex's);
        # '' = every tenant's. In the sorting key, so two tenants' prices for one model id are two rows.
        "ALTER TABLE {db}.prices ADD COLUMN IF NOT EXISTS tenant_id LowCardinality(String) AFTER model, "
        "MODIFY ORDER BY (model, token_kind, effective_from, tenant_id)",
    )),
)


def applied_versions(store: Store) -> set[int]:
    store.command("""
        CREATE TABLE IF NOT EXISTS {db}.schema_migrations (
            version UInt32, name String, applied_at DateTime64(3, 'UTC')
        ) ENGINE = ReplacingMergeTree ORDER BY version
    """)
    return {row[0] for row in store.rows("SELECT version FROM {db}.schema_migrations FINAL")}


def migrate(store: Store, migrations: tuple[Migration, ...] = MIGRATIONS) -> list[int]:
    """Apply every migration not applied yet; return the versions applied now."""
    done = applied_versions(store)
    applied = []
    for m in sorted(migrations, key=lambda m: m.version):
        if m.version in done:
            continue
        for statement in m.statements:
            store.command(statement)
        store.insert("schema_migrations", [[m.version, m.name, int(time.time() * 1000)]],
                     ["version", "name", "applied_at"])
        log.info("applied billing migration %s (%s)", m.version, m.name)
        applied.append(m.version)
    return applied
