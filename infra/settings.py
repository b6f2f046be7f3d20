"""Every environment variable tokenmill reads, declared once: name, type, default, meaning (infra/env_setting.py).

Code asks a setting for its value (`settings.MAX_LORA_RANK.get()`); the README's configuration table is
generated from these declarations (`python -m infra.settings`; tests/infra/test_settings.py holds the README to
it). Groups follow the part of the platform a setting belongs to.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from infra.env_setting import (check_all, child_environment, export, float_setting, flag_setting,  # noqa: F401
                               graphical_session, int_setting, markdown_table,
                               path_setting, positive_int, text_setting)

REPO_ROOT = Path(__file__).resolve().parents[1]

KAFKA = "Kafka"
LOCAL = "Local state and the local stack"
WORKER = "Workers and models"
INGRESS = "Ingress limits"
STRUCTURED = "Structured outputs"
LORA = "LoRA adapters"
STREAMS = "Streams (the gate)"
BILLING = "Billing and the dashboard"
CLIENTS = "Clients and tools"

# --- Kafka ------------------------------------------------------------------------------------------------------
BOOTSTRAP_SERVERS = text_setting(
    "KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:19092", "`127.0.0.1:19092` (the local broker)",
    "use an existing Kafka cluster instead (the local broker's own address, as `.local/demo.env` exports it, still "
    "means the local broker: `make up` starts it if it is down)", KAFKA)
SECURITY_PROTOCOL = text_setting(
    "KAFKA_SECURITY_PROTOCOL", "plaintext", "`plaintext`",
    "`ssl`, `sasl_plaintext` or `sasl_ssl` for every Kafka client of a shared cluster (see "
    "[docs/security.md](docs/security.md), with the ACLs each service needs)", KAFKA)
SASL_MECHANISM = text_setting("KAFKA_SASL_MECHANISM", None, "unset",
                              "`PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`, with a `sasl_*` protocol", KAFKA)
SASL_USERNAME = text_setting("KAFKA_SASL_USERNAME", None, "unset", "the SASL principal", KAFKA)
SASL_PASSWORD = text_setting("KAFKA_SASL_PASSWORD", None, "unset", "its password", KAFKA)
SSL_CA_LOCATION = text_setting("KAFKA_SSL_CA_LOCATION", None, "unset",
                               "the CA bundle that verifies the brokers (`ssl`, `sasl_ssl`)", KAFKA)
SSL_CERTIFICATE_LOCATION = text_setting("KAFKA_SSL_CERTIFICATE_LOCATION", None, "unset",
                                        "a client certificate, for mutual TLS", KAFKA)
SSL_KEY_LOCATION = text_setting("KAFKA_SSL_KEY_LOCATION", None, "unset", "its key", KAFKA)
KAFKA_REPLICATION = int_setting(
    "TOKENMILL_KAFKA_REPLICATION", 0, "min(3, the cluster's brokers)",
    "replication factor of the topics tokenmill creates (min ISR 2 from 3 replicas, else 1)", KAFKA, positive_int)
KAFKA_READ_THREADS = int_setting(
    "TOKENMILL_KAFKA_READ_THREADS", 4, "`4`",
    "the threads of ingress's own pool for the blocking Kafka reads of lookups (a stored response's settle, a "
    "background response's replay, a batch's refresh), apart from the pool that tokenizes prompts "
    "(docs/responses.md)", KAFKA, positive_int)
TOPIC_PREFIX = text_setting("TOKENMILL_TOPIC_PREFIX", "", "empty",
                            "prepended to streams' own topic names (two deployments on one cluster)", KAFKA)

# --- local state and the local stack ----------------------------------------------------------------------------
LOCAL_DIR = path_setting("TOKENMILL_LOCAL_DIR", lambda: REPO_ROOT / ".local", "`.local`",
                         "local state: secrets, logs, models, the dev broker's data", LOCAL)
KAFKA_LIBS = path_setting("TOKENMILL_KAFKA_LIBS", lambda: LOCAL_DIR.get() / "kafka" / "libs", "`.local/kafka/libs`",
                          "where `make test`/`make up` put (and the local broker runs) Apache Kafka's jars", LOCAL)
PORT = int_setting("TOKENMILL_PORT", 8080, "`8080`", "the port of `make up`'s ingress", LOCAL)
BILLING_PORT = int_setting("TOKENMILL_BILLING_PORT", 8090, "`8090`", "the port of `make up`'s billing service", LOCAL)
KAFKA_BROKERS = int_setting(
    "TOKENMILL_KAFKA_BROKERS", 1, "`1`",
    "how many Kafka brokers `make up` (and `tokenmill broker start`) runs: above 1, a local KRaft cluster on 19092, "
    "19094, ... with replication factor 3 and min ISR 2 ([docs/deploy.md](docs/deploy.md#cluster)); `tokenmill "
    "status` lists the brokers and `make down` stops them all", LOCAL, positive_int)
WORKERS = int_setting(
    "TOKENMILL_WORKERS", 1, "`1`",
    "how many workers `make up` starts (`worker`, `worker-1`, ...; metrics on 9101, then 9111, 9112, ...; the cores "
    "`make up` gives workers are split among them); `tokenmill status` lists them with their metrics URLs, and "
    "the dashboard reads them all", LOCAL, positive_int)
KEY_SECRET = text_setting("TOKENMILL_KEY_SECRET", None, "made once in `.local/key_secret`",
                          "HMAC secret for API key hashes; the same for every ingress", LOCAL)
ADMIN_TOKEN = text_setting("TOKENMILL_ADMIN_TOKEN", None, "made once in `.local/admin_token`",
                           "bearer token of the admin APIs (ingress and billing)", LOCAL)
INTERNAL_TOKEN = text_setting("TOKENMILL_INTERNAL_TOKEN", None, "made once in `.local/internal_token`",
                              "what ingress and streams present to billing's internal routes", LOCAL)
METRICS_HOST = text_setting("TOKENMILL_METRICS_HOST", "127.0.0.1", "`127.0.0.1`",
                            "where worker and streams serve Prometheus metrics (they carry tenant ids)", LOCAL)
ADMIN_HOST = text_setting("TOKENMILL_ADMIN_HOST", "127.0.0.1", "`127.0.0.1`",
                          "ingress's admin listener (admin API, `/metrics`, `/docs`); also `serve ingress "
                          "--admin-host`", LOCAL)
ADMIN_PORT = int_setting("TOKENMILL_ADMIN_PORT", 0, "the public port + 1",
                         "its port; also `serve ingress --admin-port`", LOCAL)

# --- workers and models -----------------------------------------------------------------------------------------
MODELS = text_setting(
    "TOKENMILL_MODELS", None, "`smollm2-135m-instruct=.local/models/smollm2-135m-instruct`",
    "`name=checkpoint_dir[,name=dir]`: the models ingress accepts and `make up` starts a worker for (each directory "
    "must be a checkpoint: config, safetensors, tokenizer)", WORKER)
QUANTIZATION = text_setting(
    "TOKENMILL_QUANTIZATION", None, "unset",
    "`int8`: every worker's projections and LM head in int8 (CPU only; `serve worker --quantization`), see "
    "[docs/benchmarks.md](docs/benchmarks.md) \"int8 projections\"", WORKER)
KV_CACHE_DTYPE = text_setting(
    "TOKENMILL_KV_CACHE_DTYPE", None, "unset (the weights' dtype)",
    "`float16` / `bfloat16`: every worker's KV cache in 16 bits, attention still in float32 (`serve worker "
    "--kv-cache-dtype`): half the cache memory, see [docs/benchmarks.md](docs/benchmarks.md)", WORKER)
HEARTBEAT_INTERVAL_S = float_setting(
    "TOKENMILL_HEARTBEAT_INTERVAL_S", 1.0, "`1.0`",
    "how often ingress says it still reads its reply partition; workers cancel its requests after 10 missed beats "
    "(counted only while they can reach the broker)", WORKER)
DEFAULT_MAX_TOKENS = int_setting("TOKENMILL_DEFAULT_MAX_TOKENS", 256, "`256`",
                                 "completion length when a request (HTTP or batch line) gives no `max_tokens`", WORKER)

# --- ingress limits ---------------------------------------------------------------------------------------------
SSE_WRITE_TIMEOUT_S = float_setting(
    "TOKENMILL_SSE_WRITE_TIMEOUT_S", 30.0, "`30`",
    "how long one server-sent-event write may wait for a client that stopped reading; past it the stream is given "
    "up as if the client had left (its edge slot, buffer and replay consumer released)", INGRESS)
REPLAYS_PER_TENANT = int_setting(
    "TOKENMILL_REPLAYS_PER_TENANT", 4, "`4`",
    "replayed response streams (`GET /v1/responses/{id}?stream=true`, background streams) one tenant may hold open "
    "at once on one ingress; past it a 429 `too_many_replays`", INGRESS, positive_int)
REPLAYS_TOTAL = int_setting("TOKENMILL_REPLAYS_TOTAL", 64, "`64`",
                            "the same for all tenants together", INGRESS, positive_int)
LOOKUPS_PER_TENANT = int_setting(
    "TOKENMILL_LOOKUPS_PER_TENANT", 8, "`8`",
    "response and batch lookups in progress at once per tenant on one ingress; past it a 429 `too_many_lookups` "
    "(every read also counts one request against `requests_per_minute`)", INGRESS, positive_int)
LOOKUPS_TOTAL = int_setting("TOKENMILL_LOOKUPS_TOTAL", 64, "`64`",
                            "the same for all tenants together", INGRESS, positive_int)
BATCH_DIR = path_setting("TOKENMILL_BATCH_DIR", lambda: LOCAL_DIR.get() / "batches", "`.local/batches`",
                         "where ingress keeps batch input files and manifests", INGRESS)
BATCH_MAX_FILE_BYTES = int_setting("TOKENMILL_BATCH_MAX_FILE_BYTES", 200 * 2**20, "`209715200` (200 MiB)",
                                   "the largest batch input file `/v1/files` accepts", INGRESS)
FILES_BYTES_PER_TENANT = int_setting(
    "TOKENMILL_FILES_BYTES_PER_TENANT", 2 * 2**30, "`2147483648` (2 GiB)",
    "what one tenant's files that have not expired may take in all; past it an upload is a 429 "
    "`files_quota_exceeded` (docs/batch.md)", INGRESS)
STORED_RESPONSES_PER_TENANT = int_setting(
    "TOKENMILL_STORED_RESPONSES_PER_TENANT", 100_000, "`100000`",
    "how many stored responses one tenant may have; past it a stored `POST /v1/responses` is a 429 "
    "`stored_responses_limit` before generation (docs/responses.md)", INGRESS)
STORED_RESPONSE_BYTES_PER_TENANT = int_setting(
    "TOKENMILL_STORED_RESPONSE_BYTES_PER_TENANT", 256 * 2**20, "`268435456` (256 MiB)",
    "how many bytes of stored responses one tenant may have (the same 429)", INGRESS)
RESPONSE_CACHE_BYTES = int_setting(
    "TOKENMILL_RESPONSE_CACHE_BYTES", 64 * 2**20, "`67108864` (64 MiB)",
    "the whole stored-response records each ingress keeps in memory (least recently used evicted, read back from "
    "`responses` when needed)", INGRESS)
MAX_STORED_RESPONSE_BYTES = int_setting(
    "TOKENMILL_MAX_STORED_RESPONSE_BYTES", 900_000, "`900000`",
    "the largest stored-response record, with room for its answer (under one Kafka message); a bigger one is a 400 "
    "`response_too_large` before generation", INGRESS)

# --- structured outputs (docs/structured_outputs.md) ------------------------------------------------------------
MAX_SCHEMA_BYTES = int_setting("TOKENMILL_MAX_SCHEMA_BYTES", 64 * 1024, "`65536`",
                               "the largest `response_format` JSON schema (or tools) ingress accepts (400 beyond)",
                               STRUCTURED)
GRAMMAR_COMPILE_TIMEOUT_S = float_setting(
    "TOKENMILL_GRAMMAR_COMPILE_TIMEOUT_S", 5.0, "`5`",
    "how long one schema may take to compile; past it the compile process is killed and the request is a 400",
    STRUCTURED)
GRAMMAR_COMPILE_PROCESSES = int_setting("TOKENMILL_GRAMMAR_COMPILE_PROCESSES", 2, "`2`",
                                        "compile processes per model", STRUCTURED, positive_int)
GRAMMAR_QUEUE_WAIT_S = float_setting("TOKENMILL_GRAMMAR_QUEUE_WAIT_S", 5.0, "`5`",
                                     "how long a compile may wait for a process (then 503 `grammar_compiler_busy`)",
                                     STRUCTURED)
GRAMMAR_COMPILES_PER_TENANT = int_setting("TOKENMILL_GRAMMAR_COMPILES_PER_TENANT", 8, "`8`",
                                          "compiles one tenant may have waiting or running at once (503 past it)",
                                          STRUCTURED)
GRAMMAR_WARM = flag_setting(
    "TOKENMILL_GRAMMAR_WARM", True, "`1`",
    "a worker starts its compile processes as it starts (each imports xgrammar and torch, seconds of CPU); `0` "
    "starts them at the first structured-output request, which then waits for them", STRUCTURED)
GRAMMAR_MEMORY_MB = int_setting("TOKENMILL_GRAMMAR_MEMORY_MB", 2048, "`2048`",
                                "the memory (RLIMIT_DATA) of each grammar-compile process; past it the compile fails "
                                "alone", STRUCTURED, positive_int)
MAX_SCHEMA_DEPTH = int_setting("TOKENMILL_MAX_SCHEMA_DEPTH", 32, "`32`",
                               "a schema's nesting depth before it is compiled (400 naming the path)", STRUCTURED)
MAX_SCHEMA_KEYS = int_setting("TOKENMILL_MAX_SCHEMA_KEYS", 4096, "`4096`", "a schema's keys", STRUCTURED)
MAX_SCHEMA_ENUM = int_setting("TOKENMILL_MAX_SCHEMA_ENUM", 1024, "`1024`", "a schema's enum values", STRUCTURED)
MAX_PATTERN_CHARS = int_setting("TOKENMILL_MAX_PATTERN_CHARS", 1000, "`1000`", "a `pattern`'s length", STRUCTURED)
MAX_PATTERN_REPEAT = int_setting("TOKENMILL_MAX_PATTERN_REPEAT", 4096, "`4096`",
                                 "a `pattern`'s largest repetition bound", STRUCTURED)
MAX_PATTERN_REPEAT_PRODUCT = int_setting(
    "TOKENMILL_MAX_PATTERN_REPEAT_PRODUCT", 16, "`16`",
    "the product of the bounds of repetitions nested in each other in one `pattern`", STRUCTURED)
MAX_SCHEMA_REPEAT_TOTAL = int_setting(
    "TOKENMILL_MAX_SCHEMA_REPEAT_TOTAL", 64, "`64`",
    "that product summed over a schema's patterns that nest repetitions: many patterns each under the limit are "
    "refused together", STRUCTURED)

# --- LoRA adapters (docs/lora.md) -------------------------------------------------------------------------------
MAX_LORAS = int_setting("TOKENMILL_MAX_LORAS", 4, "`4`",
                        "LoRA adapters a worker's engine holds at once (slots, least recently used evicted; `serve "
                        "worker --max-loras`); see [docs/lora.md](docs/lora.md)", LORA)
MAX_LORA_RANK = int_setting("TOKENMILL_MAX_LORA_RANK", 64, "`64`",
                            "the largest adapter rank: the registry refuses more (400, `adapter_config.r`), the "
                            "engine sizes its slots by it", LORA)
MAX_ADAPTER_BYTES = int_setting("TOKENMILL_MAX_ADAPTER_BYTES", 64 * 2**20, "`64 MiB`",
                                "the largest `adapter_model.safetensors` the registry accepts (400 "
                                "`adapter_too_large`)", LORA)
MAX_ADAPTERS_PER_TENANT = int_setting("TOKENMILL_MAX_ADAPTERS_PER_TENANT", 16, "`16`",
                                      "adapters one tenant may have registered at once (429 "
                                      "`adapter_quota_exceeded`)", LORA)
MAX_ADAPTER_BYTES_PER_TENANT = int_setting(
    "TOKENMILL_MAX_ADAPTER_BYTES_PER_TENANT", 256 * 2**20, "`256 MiB`",
    "the sum of one tenant's adapter files (429 `adapter_quota_exceeded`): every worker follows every adapter", LORA)
ADAPTER_CACHE_DIR = path_setting("TOKENMILL_ADAPTER_CACHE_DIR", lambda: LOCAL_DIR.get() / "adapter-cache",
                                 "`.local/adapter-cache`",
                                 "where workers write the adapters they serve (`<worker id>/<version>` under it)", LORA)

# --- streams, the gate (docs/streams.md; each timing explained there) ------------------------------------------
STREAMS_APP_ID = text_setting("TOKENMILL_STREAMS_APP_ID", "tokenmill-streams", "`tokenmill-streams`",
                              "streams' Faust app id (two deployments on one cluster)", STREAMS)
TOKEN_WEIGHTS = text_setting("TOKENMILL_TOKEN_WEIGHTS", "", "`input=1,output=1,cached_input=1`",
                             "how tokens count against quota (ingress and streams read it, so the edge and the "
                             "authority count alike)", STREAMS)
STREAMS_PLACEMENT = text_setting(
    "TOKENMILL_STREAMS_PLACEMENT", "prefix-aware", "`prefix-aware`",
    "where a released request runs when its model has two or more workers: `prefix-aware` sends it to the worker "
    "whose prefix cache holds the most of its prompt's leading blocks (within free slots), `least-loaded` to the "
    "worker with the most free slots (docs/streams.md, \"Placement\")", STREAMS)
STREAMS_PREEMPTION = flag_setting(
    "TOKENMILL_STREAMS_PREEMPTION", True, "`1`",
    "`0` stops streams from preempting running sequences for fairness or priority (slots then move only as "
    "sequences end)", STREAMS)
STREAMS_PREEMPT_HYSTERESIS_S = float_setting(
    "TOKENMILL_STREAMS_PREEMPT_HYSTERESIS_S", 10.0, "`10`",
    "a tenant that lost a slot to another cannot take one back from it for this long", STREAMS)
BUDGET_POLL_S = float_setting("TOKENMILL_BUDGET_POLL_S", 30.0, "`30`",
                              "how often streams asks billing for each tenant's month-to-date usage (monthly budgets)",
                              STREAMS)
STREAMS_METRICS_PORT = int_setting("TOKENMILL_STREAMS_METRICS_PORT", 9102, "`9102`",
                                   "streams' Prometheus port, 0 for none (also read by `tokenmill queue`)", STREAMS)
STREAMS_ADVERT_TTL_S = float_setting("TOKENMILL_STREAMS_ADVERT_TTL_S", 5.0, "`5`",
                                     "a worker advert older than this (by its own timestamp) no longer grants credits",
                                     STREAMS)
STREAMS_IN_TRANSIT_TTL_S = float_setting(
    "TOKENMILL_STREAMS_IN_TRANSIT_TTL_S", 3.0, "`3`",
    "a released request no worker has taken in stops holding a credit after this long", STREAMS)
STREAMS_SHED_INTERVAL_S = float_setting("TOKENMILL_STREAMS_SHED_INTERVAL_S", 0.05, "`0.05`",
                                        "how often queued requests past their deadline are shed", STREAMS)
STREAMS_QUOTA_PUBLISH_S = float_setting("TOKENMILL_STREAMS_QUOTA_PUBLISH_S", 0.2, "`0.2`",
                                        "a tenant's quota state is published at most this often", STREAMS)
STREAMS_BATCH_AGING_S = float_setting("TOKENMILL_STREAMS_BATCH_AGING_S", 30.0, "`30`",
                                      "a batch request competes as interactive after waiting this long", STREAMS)
STREAMS_SESSION_TIMEOUT_S = float_setting(
    "TOKENMILL_STREAMS_SESSION_TIMEOUT_S", 6.0, "`6`",
    "Faust group liveness: how fast a standby notices that the active instance died", STREAMS)
STREAMS_RECOVERY_TIMEOUT_S = float_setting(
    "TOKENMILL_STREAMS_RECOVERY_TIMEOUT_S", 30.0, "`30`",
    "an instance stuck this long (in a rebalance, or with a loop that stopped) exits to be restarted "
    "(streams/watchdog.py)", STREAMS)
STREAMS_TRACE = flag_setting("TOKENMILL_STREAMS_TRACE", False, "`0`",
                             "`1`: streams logs every gate decision (debugging)", STREAMS)
STREAMS_SUPERVISED = flag_setting("TOKENMILL_STREAMS_SUPERVISED", False, "set by `serve streams`",
                                  "marks the child the streams supervisor runs (internal)", STREAMS)

# --- billing and the dashboard (docs/billing.md, docs/dashboard.md) --------------------------------------------
CLICKHOUSE_URL = text_setting("TOKENMILL_CLICKHOUSE_URL", None, "`chdb://.local/clickhouse`",
                              "the ledger: embedded chDB, or `http(s)://` for a ClickHouse server", BILLING)
CLICKHOUSE_DATABASE = text_setting("TOKENMILL_CLICKHOUSE_DATABASE", "tokenmill", "`tokenmill`",
                                   "the ClickHouse database of the ledger", BILLING)
BILLING_URL = text_setting("TOKENMILL_BILLING_URL", "http://127.0.0.1:8090", "`http://127.0.0.1:8090`",
                           "where ingress (the `/v1/usage` routes) and streams (monthly budgets) reach the billing "
                           "service", BILLING)
DASHBOARD_SECURE_COOKIE = flag_setting(
    "TOKENMILL_DASHBOARD_SECURE_COOKIE", False, "`0`",
    "`1`: the dashboard's session cookie is Secure even on a plain-HTTP loopback request (behind a TLS proxy on "
    "the same machine that passes a loopback Host and no `X-Forwarded-*` header; docs/dashboard.md)", BILLING)
STREAMS_METRICS_URL = text_setting("TOKENMILL_STREAMS_METRICS_URL", None, "streams' port on loopback",
                                   "where the dashboard's live panel reads the gate", BILLING)
WORKER_METRICS_URLS = text_setting("TOKENMILL_WORKER_METRICS_URLS", "http://127.0.0.1:9101/metrics",
                                   "`http://127.0.0.1:9101/metrics` (the `make up` worker)",
                                   "where it reads the workers (comma-separated)", BILLING)
INGRESS_METRICS_URL = text_setting("TOKENMILL_INGRESS_METRICS_URL", None, "ingress's admin listener",
                                   "where it reads ingress's refusals", BILLING)

# --- clients and tools ------------------------------------------------------------------------------------------
BASE_URL = text_setting("TOKENMILL_BASE_URL", None, "written by `make up` to `.local/demo.env`",
                        "the demo tenant's endpoint; `tokenmill bench serve` and `tokenmill batch` read it", CLIENTS)
API_KEY = text_setting("TOKENMILL_API_KEY", None, "written by `make up` to `.local/demo.env`",
                       "the demo tenant's key (read by the same two)", CLIENTS)
MODEL = text_setting("TOKENMILL_MODEL", None, "written by `make up` to `.local/demo.env`",
                     "the demo model (read by the same two)", CLIENTS)
ADMIN_URL = text_setting("TOKENMILL_ADMIN_URL", None, "written by `make up` to `.local/demo.env`",
                         "the admin listener", CLIENTS)
BENCH_CACHE = path_setting("TOKENMILL_CACHE", lambda: Path(tempfile.gettempdir()) / "tokenmill-bench",
                           "`tokenmill-bench` in the temp dir",
                           "where `tokenmill bench engine` keeps the checkpoints it builds", CLIENTS)

if __name__ == "__main__":
    sys.stdout.write(markdown_table())
