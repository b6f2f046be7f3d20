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

The routes are in ``http/`` (by audience) and ``dashboard/``; ``create_app`` only composes them.
"""
from __future__ import annotations

import argparse
import logging
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI

from billing_pipeline import migrations
from billing_pipeline.consumer import DEFAULT_GROUP, LedgerWriter
from billing_pipeline.dashboard.live import LiveSources
from billing_pipeline.dashboard.routes import mount_dashboard
from billing_pipeline.http import admin_routes, health_routes, tenant_routes
from billing_pipeline.http.context import BillingContext
from billing_pipeline.store import Store, set_default_store
from infra.config import admin_token, billing_url, internal_token, same_secret  # noqa: F401  (re-exported)
from http_api.openai_errors import answer_errors_in_openai_format

log = logging.getLogger("tokenmill.billing")

DEFAULT_PORT = 8090


@asynccontextmanager
async def _writer_runs_with_the_app(app: FastAPI):
    writer = app.state.billing.writer
    if writer is not None:
        writer.start()
    yield
    if writer is not None:
        writer.stop()


def create_app(store: Store, writer: LedgerWriter | None = None, *, internal: str | None = None,
               admin: str | None = None, live_sources: LiveSources | None = None) -> FastAPI:
    """The HTTP app. ``writer`` (optional) is started and stopped with the app. ``live_sources``:
    where the dashboard's live panel reads the queue and the workers (default: from the environment)."""
    context = BillingContext(store, writer, internal or internal_token(), admin or admin_token())
    app = FastAPI(title="tokenmill billing", lifespan=_writer_runs_with_the_app)
    app.state.billing = context
    answer_errors_in_openai_format(app)  # as ingress answers, so a forwarded /v1/usage error reads the same
    app.include_router(health_routes.router)
    app.include_router(tenant_routes.router)
    app.include_router(admin_routes.router)
    mount_dashboard(app, store, context.admin_token, live_sources)
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
