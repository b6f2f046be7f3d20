"""The billing process: the LedgerWriter thread plus a small HTTP analytics service.

chDB lets one process open its directory, so this process owns ClickHouse and answers every
usage question over HTTP (default port 8090; clients find it at ``TOKENMILL_BILLING_URL``).

Auth:
* tenant endpoints (``/v1/usage...``): ingress authenticates the API key and forwards the
  tenant in ``x-tokenmill-tenant`` together with the internal service token in
  ``x-tokenmill-internal-token`` (``TOKENMILL_INTERNAL_TOKEN``, else the secret kept in
  ``.local/internal_token``). The tenant comes only from that header; a request naming any other
  tenant is refused with 403.
* admin endpoints (``/admin/...``): ``Authorization: Bearer <TOKENMILL_ADMIN_TOKEN>`` (or
  ``x-tokenmill-admin-token``); without a configured token, the secret in ``.local/admin_token``.
"""
from __future__ import annotations

import argparse
import logging
import sys
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from billing_pipeline import analytics, budget, ledger, migrations, pricing
from billing_pipeline.consumer import DEFAULT_GROUP, LedgerWriter
from billing_pipeline.dashboard.live import LiveSources
from billing_pipeline.dashboard.routes import mount_dashboard
from billing_pipeline.store import Store, set_default_store
from infra.bearer import bearer_token
from infra.config import admin_token, billing_url, internal_token, same_secret  # noqa: F401  (re-exported)
from infra.openai_errors import answer_errors_in_openai_format

log = logging.getLogger("tokenmill.billing")

DEFAULT_PORT = 8090
TENANT_HEADER = "x-tokenmill-tenant"
INTERNAL_TOKEN_HEADER = "x-tokenmill-internal-token"
ADMIN_TOKEN_HEADER = "x-tokenmill-admin-token"



_same = same_secret


class PriceIn(BaseModel):
    model: str
    token_kind: str
    usd_per_mtok: float | str
    effective_from: int | str | None = None


class LookupIn(BaseModel):
    request_ids: list[str]


def create_app(store: Store, writer: LedgerWriter | None = None, *, internal: str | None = None,
               admin: str | None = None, live_sources: LiveSources | None = None) -> FastAPI:
    """The HTTP app. ``writer`` (optional) is started and stopped with the app. ``live_sources``:
    where the dashboard's live panel reads the queue and the workers (default: from the environment)."""
    internal = internal or internal_token()
    admin = admin or admin_token()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if writer is not None:
            writer.start()
        yield
        if writer is not None:
            writer.stop()

    app = FastAPI(title="tokenmill billing", lifespan=lifespan)
    answer_errors_in_openai_format(app)  # as ingress answers, so a forwarded /v1/usage error reads the same

    def tenant_of(request: Request) -> str:
        if not _same(request.headers.get(INTERNAL_TOKEN_HEADER), internal):
            raise HTTPException(401, "missing or invalid internal service token")
        tenant = request.headers.get(TENANT_HEADER)
        if not tenant:
            raise HTTPException(401, f"missing {TENANT_HEADER}")
        asked = request.query_params.get("tenant_id") or request.query_params.get("tenant")
        if asked is not None and asked != tenant:
            raise HTTPException(403, "a tenant can only read its own usage")
        return tenant

    def require_admin(request: Request) -> None:
        token = bearer_token(request.headers.get("authorization"))
        if token is None:
            token = request.headers.get(ADMIN_TOKEN_HEADER)
        if not _same(token, admin):  # missing or wrong: one answer, as ingress gives
            raise HTTPException(401, "admin token required")

    def window(since: str | None, until: str | None) -> tuple[int | None, int | None]:
        try:
            return analytics.parse_time(since), analytics.parse_time(until)
        except ValueError as exc:
            raise HTTPException(400, f"bad time: {exc}") from None

    def tenant_report(tenant: str, since, until, bucket: str, model: str | None) -> dict[str, Any]:
        s, u = window(since, until)
        if bucket not in analytics.BUCKETS:
            raise HTTPException(400, f"bucket must be one of {sorted(analytics.BUCKETS)}")
        out = analytics.tenant_totals(store, tenant, s, u)
        out["bucket"] = bucket
        out["series"] = analytics.tenant_timeseries(store, tenant, bucket, s, u, model)
        return out

    @app.get("/health")
    def health() -> dict:
        ok = writer is None or (writer.alive and writer.error is None)
        body = {"status": "ok" if ok else "degraded", "writer": None}
        if writer is not None:
            body["writer"] = {**writer.stats.as_dict(), "alive": writer.alive,
                              # the kind only: /health answers anyone, the details are in the log
                              "error": type(writer.error).__name__ if writer.error else None}
        return body if ok else JSONResponse(body, status_code=503)

    @app.get("/metrics")
    def metrics() -> Response:
        """The ledger writer's counters in Prometheus text format (names prefixed `tokenmill:`)."""
        lines = []
        if writer is not None:
            stats = writer.stats.as_dict()
            for name, kind, help_text in (
                    ("consumed", "counter", "usage events read from Kafka"),
                    ("inserted", "counter", "ledger rows inserted"),
                    ("dead_lettered", "counter", "usage events sent to dead-letters"),
                    ("batches", "counter", "insert batches"),
                    ("commits", "counter", "offset commits after an insert"),
                    ("insert_errors", "counter", "failed inserts (retried)"),
                    ("lag_ms", "gauge", "age of the newest event of the last batch when written")):
                metric = f"tokenmill:billing_{name}" + ("_total" if kind == "counter" else "")
                lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f"{metric} {stats[name]}"]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # --- tenant-scoped --------------------------------------------------------------------
    @app.get("/v1/usage")
    def my_usage(tenant: str = Depends(tenant_of), since: str | None = "30d", until: str | None = None,
                 bucket: str = "day", model: str | None = None) -> dict:
        return tenant_report(tenant, since, until, bucket, model)

    @app.get("/v1/usage/month-to-date")
    def my_month_to_date(tenant: str = Depends(tenant_of)) -> dict:
        return {"tenant_id": tenant, **budget.month_to_date_detail(tenant, store=store)[tenant]}

    # --- admin --------------------------------------------------------------------------------
    adm = [Depends(require_admin)]

    @app.get("/admin/usage/tenants/{tenant_id}", dependencies=adm)
    def tenant_usage(tenant_id: str, since: str | None = "30d", until: str | None = None, bucket: str = "day",
                     model: str | None = None) -> dict:
        return tenant_report(tenant_id, since, until, bucket, model)

    @app.get("/admin/usage/top-tenants", dependencies=adm)
    def top(since: str | None = "30d", until: str | None = None, limit: int = Query(10, ge=1, le=1000),
            by: str = "tokens") -> list[dict]:
        if by not in ("tokens", "cost", "requests"):
            raise HTTPException(400, "by must be tokens, cost or requests")
        return analytics.top_tenants(store, *window(since, until), limit=limit, by=by)

    @app.get("/admin/usage/models", dependencies=adm)
    def models(since: str | None = "30d", until: str | None = None) -> list[dict]:
        return analytics.by_model(store, *window(since, until))

    @app.get("/admin/usage/latency", dependencies=adm)
    def latency(since: str | None = "1d", until: str | None = None) -> list[dict]:
        return analytics.latency_by_model(store, *window(since, until))

    @app.get("/admin/usage/summary", dependencies=adm)
    def summary(since: str | None = "1d", until: str | None = None, limit: int = 10) -> dict:
        return analytics.summary(store, *window(since, until), limit=limit)

    @app.get("/admin/usage/month-to-date", dependencies=adm)
    def month_to_date(tenant_id: str | None = None) -> dict:
        return budget.month_to_date_detail(tenant_id, store=store)

    @app.get("/admin/ledger/requests", dependencies=adm)
    def ledger_requests(since: str | None = "1d", until: str | None = None, tenant_id: str | None = None,
                        limit: int = Query(100_000, ge=1, le=1_000_000)) -> list[dict]:
        return analytics.requests_in_window(store, *window(since, until), tenant_id=tenant_id, limit=limit)

    @app.post("/admin/ledger/lookup", dependencies=adm)
    def ledger_lookup(body: LookupIn) -> list[dict]:
        return analytics.lookup_requests(store, body.request_ids)

    @app.get("/admin/ledger/totals", dependencies=adm)
    def ledger_totals() -> dict:
        return analytics.ledger_totals(store)

    @app.post("/admin/ledger/rebuild-aggregate", dependencies=adm)
    def rebuild() -> dict:
        return {"buckets": ledger.rebuild_aggregate(store)}

    @app.get("/admin/prices", dependencies=adm)
    def prices() -> list[dict]:
        return pricing.list_prices(store)

    @app.put("/admin/prices", dependencies=adm)
    def put_price(body: PriceIn) -> dict:
        try:
            out = pricing.set_price(store, body.model, body.token_kind, body.usd_per_mtok, body.effective_from)
        except (ValueError, TypeError) as exc:
            raise HTTPException(400, str(exc)) from None
        if writer is not None:
            writer.reload_prices()
        return out

    mount_dashboard(app, store, admin, live_sources)
    return app


def main(argv: list[str] | None = None) -> None:
    """`tokenmill serve billing`: migrate, start the ledger writer and serve HTTP."""
    import uvicorn

    p = argparse.ArgumentParser(prog="tokenmill serve billing")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--clickhouse-url", default=None, help="chdb:///dir or http(s)://... (TOKENMILL_CLICKHOUSE_URL)")
    p.add_argument("--database", default=None)
    p.add_argument("--group", default=DEFAULT_GROUP, help="consumer group of the ledger writer")
    p.add_argument("--no-writer", action="store_true", help="serve analytics only")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = Store(args.clickhouse_url, args.database)
    applied = migrations.migrate(store)
    if applied:
        log.info("migrations applied: %s", applied)
    set_default_store(store)
    writer = None if args.no_writer else LedgerWriter(store, group_id=args.group)
    app = create_app(store, writer)
    log.info("billing service on http://%s:%s (ClickHouse %s, db %s)", args.host, args.port, store.display_url,
             store.database)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
