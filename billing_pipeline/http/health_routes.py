"""`/health` and `/metrics`: the ledger writer's state, for probes and Prometheus (no token)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from billing_pipeline.http.context import Context

router = APIRouter()

# (counter name in LedgerWriter.stats, Prometheus type, help)
WRITER_METRICS = (
    ("consumed", "counter", "usage events read from Kafka"),
    ("inserted", "counter", "ledger rows inserted"),
    ("dead_lettered", "counter", "usage events sent to dead-letters"),
    ("batches", "counter", "insert batches"),
    ("commits", "counter", "offset commits the broker confirmed"),
    ("insert_errors", "counter", "failed inserts (retried)"),
    ("lag_ms", "gauge", "age of the newest event of the last batch when written"),
)


@router.get("/health")
def health(context: Context, response: Response) -> dict:
    writer = context.writer
    ok = writer is None or (writer.alive and writer.error is None)
    body: dict[str, Any] = {"status": "ok" if ok else "degraded", "writer": None}
    if writer is not None:
        body["writer"] = {**writer.stats.as_dict(), "alive": writer.alive,
                          # the kind only: /health answers anyone, the details are in the log
                          "error": type(writer.error).__name__ if writer.error else None}
    if not ok:
        response.status_code = 503
    return body


@router.get("/metrics")
def metrics(context: Context) -> Response:
    """The ledger writer's counters in Prometheus text format (names prefixed `tokenmill:`)."""
    lines = []
    if context.writer is not None:
        stats = context.writer.stats.as_dict()
        for name, kind, help_text in WRITER_METRICS:
            metric = f"tokenmill:billing_{name}" + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f"{metric} {stats[name]}"]
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
