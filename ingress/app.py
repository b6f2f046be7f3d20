"""The OpenAI-compatible HTTP edge, assembled: the public listener (every API surface under ingress/api/)
and the operators' listener (ingress/admin/), over one IngressContext (context.py) per process.

Each request becomes one `InferenceRequested` event on `requests`, acknowledged by the broker before the
client is answered (serving/submitter.py); the tokens come back on this process's own partition of
`replies` (kafka/reply_router.py) and are written to the client's stream as they arrive.
"""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from http_api.openai_errors import APIError, answer_errors_in_openai_format
from ingress.admin.adapters import registration_body_limit, router as adapters_router
from ingress.admin.routes import AdminAccess, router as admin_router
from ingress.api.batches.routes import max_file_bytes, router as batch_router, serving_batches
from ingress.api.chat.routes import router as chat_router
from ingress.api.completions.routes import router as completions_router
from ingress.api.models.routes import router as models_router
from ingress.api.responses.routes import router as responses_router
from ingress.api.responses.finalizer import ResponseFinalizer
from ingress.api.responses.follower import ResponseFollower
from ingress.api.usage.routes import UsageProxy, router as usage_router
from ingress.context import IngressContext, IngressSettings
from ingress.http.body_limit import BodyLimit
from ingress.http.json_body import MAX_BODY_BYTES
from ingress.http.openapi_contract import document_contract



def body_limit_for(path: str) -> tuple[int, str]:
    """Uploads may be as large as a batch file (plus the multipart framing); everything else is JSON."""
    if path.rstrip("/") == "/v1/files":
        return max_file_bytes() + 65536, "file_too_large"
    if path.startswith("/admin/tenants/") and path.rstrip("/").endswith("/adapters"):  # a LoRA adapter, in base64
        return registration_body_limit(), "request_too_large"
    return MAX_BODY_BYTES, "request_too_large"


def _answer_errors(app: FastAPI, context: IngressContext) -> None:
    app.add_middleware(BodyLimit, limit_for=body_limit_for)

    def count(exc: APIError) -> None:
        context.metrics.rejections.labels(str(exc.status), exc.code or exc.error_type).inc()

    answer_errors_in_openai_format(app, on_error=count)


def create_admin_app(context: IngressContext) -> FastAPI:
    """The operators' listener (tenants, keys, quota views, /docs), served beside the public one by
    the same process; it binds to loopback unless told otherwise (docs/security.md)."""
    app = FastAPI(title="tokenmill admin", version="0.1.0")
    document_contract(app)
    app.state.context = context
    app.state.admin = AdminAccess(context.settings.secret)
    _answer_errors(app, context)
    app.include_router(admin_router)
    app.include_router(adapters_router)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return Response(generate_latest(context.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def create_app(settings: IngressSettings | None = None) -> FastAPI:
    context = IngressContext(settings or IngressSettings())
    responses = ResponseFollower(client_id=f"{context.settings.process_id}-responses")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await context.start()
        responses.start()
        finalizer = ResponseFinalizer(f"{context.settings.process_id}-finalizer", responses, context.producer,
                                      context.kafka_reads)
        finalizer.start()
        yield
        await finalizer.stop()
        responses.stop()
        await context.stop()

    # The public listener carries no admin routes and no /docs (the admin listener has them); its
    # OpenAPI document describes the client API only.
    app = FastAPI(title="tokenmill", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    document_contract(app)
    app.state.context = context
    app.state.responses = responses
    app.state.batches = serving_batches(context)
    app.state.usage = UsageProxy()
    _answer_errors(app, context)
    for router in (batch_router, usage_router, responses_router, models_router, chat_router, completions_router):
        app.include_router(router)

    @app.get("/health")
    async def health():
        return {"status": "ok", "reply_partition": context.settings.reply_partition}

    return app
