"""The OpenAI-compatible HTTP edge: authenticate, validate, tokenize, admit, then stream.

Each request becomes one `InferenceRequested` event on `requests`, acknowledged by
the broker before the client is answered; the tokens come back on this process's own
partition of `replies` and are written to the client's stream as they arrive.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.requests import ClientDisconnect
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from ingress.admin.routes import admin_router
from ingress.api.responses.background_replies import reply_partition as background_partition
from ingress.api.batches.routes import MAX_FILE_BYTES, batch_router
from ingress.tenancy.admission import EdgeAdmission
from ingress.http.body_limit import BodyLimit
from infra.openai_errors import APIError
from ingress.kafka.producer import AsyncProducer
from ingress.http import json_numbers
from ingress.metrics import IngressMetrics
from ingress.http.openapi_contract import STREAMABLE, document_contract
from ingress.protocol import ChatCompletionRequest, CompletionRequest, first_error, openapi_body
from ingress.kafka.reply_router import ReplyRouter
from ingress.serving.request_builder import inference_requested, structured_spec
from ingress.api.responses.store import ResponseFollower
from ingress.serving.request_view import RequestView
from ingress.serving.request_stream import RequestStream, SseFrames
from ingress.api.responses.routes import responses_router
from ingress.serving.served_model import ServedModel
from ingress.tenancy.directory import Caller, TenantFollower
from ingress.api.usage.routes import usage_router
from schemas import codec, topics
from infra.config import ModelSpec, default_max_tokens, heartbeat_interval_s, key_secret, served_models
from infra.grammars import GrammarBusy, GrammarError

log = logging.getLogger("tokenmill.ingress")

MAX_BODY_BYTES = 4 * 2**20
# Prompts of one tenant tokenized at the same time (the shared pool has about cores + 4 threads).
TOKENIZE_PER_TENANT = 2
REPLY_GRACE_S = 30.0


@dataclass
class IngressSettings:
    reply_partition: int = 0
    models: dict[str, ModelSpec] = field(default_factory=served_models)
    secret: bytes = field(default_factory=key_secret)
    process_id: str = field(default_factory=lambda: f"ingress-{uuid.uuid4().hex[:8]}")
    default_max_tokens: int = field(default_factory=default_max_tokens)
    heartbeat_interval_s: float = field(default_factory=heartbeat_interval_s)


class Ingress:
    def __init__(self, settings: IngressSettings):
        self.settings = settings
        self.models = {name: ServedModel(spec) for name, spec in settings.models.items()}
        self.tenants = TenantFollower(client_id=f"{settings.process_id}-tenants", dead_letters=True)
        self.response_follower = ResponseFollower(client_id=f"{settings.process_id}-responses")
        self.responses = self.response_follower.store
        self.admission = EdgeAdmission()
        self.metrics = IngressMetrics()
        self.producer: AsyncProducer | None = None
        self.router: ReplyRouter | None = None
        self.incarnation = uuid.uuid4().hex[:16]
        self._heartbeat: asyncio.Task | None = None
        self._tokenizing: dict[str, asyncio.Semaphore] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.producer = AsyncProducer(self.settings.process_id)
        self.router = ReplyRouter(self.settings.reply_partition, loop)
        await asyncio.to_thread(self.router.start)
        await asyncio.to_thread(self.tenants.start)
        self.response_follower.start()
        self.admission.start(self.settings.process_id)
        self._heartbeat = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        """Tell workers this process still reads its reply partition; when the beats stop (or a new
        process takes the partition over), they cancel the requests nobody will read."""
        while True:
            self._send_heartbeat(stopping=False)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    def _send_heartbeat(self, stopping: bool) -> None:
        beat = codec.new_event("IngressHeartbeat", reply_topic=topics.REPLIES.name,
                               reply_partition=self.settings.reply_partition, incarnation=self.incarnation,
                               interval_ms=int(self.settings.heartbeat_interval_s * 1000), stopping=stopping)
        self.producer.send_nowait(topics.INGRESS_HEARTBEATS.name,
                                  f"{topics.REPLIES.name}:{self.settings.reply_partition}", "IngressHeartbeat", beat)

    async def stop(self) -> None:
        if self._heartbeat:
            self._heartbeat.cancel()
            self._send_heartbeat(stopping=True)
        self.admission.stop()
        if self.router:
            self.router.stop()
        self.tenants.stop()
        self.response_follower.stop()
        if self.producer:
            self.producer.close()

    # --- request handling ---
    def authenticate(self, request: Request) -> Caller:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                           code="missing_api_key")
        caller = self.tenants.directory.authenticate(token.strip() if scheme.lower() == "bearer" else None,
                                                     self.settings.secret)
        if caller is None:
            raise APIError(401, "Incorrect, revoked or unknown API key.", code="invalid_api_key")
        return caller

    async def parse(self, request: Request, model_cls):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"Request body exceeds {MAX_BODY_BYTES} bytes.", code="request_too_large")
        try:
            raw = await request.body()
        except ClientDisconnect:
            raise APIError(499, "The client closed the connection while sending the body.",
                           code="client_disconnected") from None
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"Request body exceeds {MAX_BODY_BYTES} bytes.", code="request_too_large")
        try:
            data = json_numbers.loads(raw)
            # JSON escapes can smuggle in lone surrogates, which are not text any tokenizer can take.
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except (UnicodeDecodeError, UnicodeEncodeError, json.JSONDecodeError) as exc:
            raise APIError(400, f"We could not parse the JSON body of your request: {exc}.",
                           code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "The JSON body is nested too deeply.", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            message, param = first_error(exc)
            raise APIError(400, message, param=param, code="invalid_value") from None

    def resolve_model(self, caller: Caller, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise APIError(404, f"The model '{name}' does not exist.", code="model_not_found", param="model")
        allowed = caller.tenant["allowed_models"]
        if allowed and name not in allowed:
            raise APIError(403, f"Your plan does not include the model '{name}'.", code="model_not_allowed",
                           param="model")
        return model

    def _tokenizing_slot(self, tenant_id: str) -> asyncio.Semaphore:
        slot = self._tokenizing.get(tenant_id)
        if slot is None:
            slot = self._tokenizing[tenant_id] = asyncio.Semaphore(TOKENIZE_PER_TENANT)
        return slot

    async def _tokenize(self, caller: Caller, model: ServedModel, body, chat: bool,
                        spec: dict | None = None) -> tuple[list[int], int]:
        """The prompt's token ids and the completion length, or a 413 if they cannot fit. A structured-
        output ``spec`` is compiled here too, under the same per-tenant slot (a tenant sending slow
        schemas holds its own slots, not everyone's), so a bad one costs no queueing and no GPU time."""
        if model.surely_too_long(model.texts_of(body, chat)):
            raise APIError(413, f"This model's maximum context length is {model.max_model_len} tokens, and the "
                                f"prompt is longer than that.", code="context_length_exceeded",
                           param="messages" if chat else "prompt")
        # Tokenizing runs in a thread pool all tenants share: one tenant gets a few threads at a time.
        async with self._tokenizing_slot(caller.tenant_id):
            if chat:
                prompt_ids = await asyncio.to_thread(model.chat_prompt, body.messages, body.tools)
            else:
                prompt_ids = await asyncio.to_thread(model.text_prompt, body.prompt)
            if spec is not None:
                try:
                    await asyncio.to_thread(model.grammars.compile, spec)
                except GrammarBusy as exc:
                    raise APIError(503, str(exc), code="grammar_compiler_busy", headers={"Retry-After": "1"}) from None
                except GrammarError as exc:
                    raise APIError(400, str(exc), code="invalid_response_format", param=exc.param) from None
        room = model.max_model_len - len(prompt_ids)
        max_tokens = body.requested_max_tokens()
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise APIError(413, f"This model's maximum context length is {model.max_model_len} tokens. "
                                f"However, you requested {len(prompt_ids) + (max_tokens or 0)} tokens "
                                f"({len(prompt_ids)} in the prompt, {max_tokens or 0} for the completion).",
                           code="context_length_exceeded", param="messages" if chat else "prompt")
        return prompt_ids, max_tokens or min(room, self.settings.default_max_tokens)

    async def handle(self, request: Request, chat: bool):
        arrived_ms = int(time.time() * 1000)
        caller = self.authenticate(request)
        self.admission.precheck(caller)
        body = await self.parse(request, ChatCompletionRequest if chat else CompletionRequest)
        stream = await self.submit(request, caller, body, chat, arrived_ms)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream.sse(SseFrames(stream.view, include_usage))
        return await stream.whole()

    async def submit(self, request: Request, caller: Caller, body, chat: bool, arrived_ms: int,
                     id_prefix: str | None = None, background: bool = False) -> "RequestStream":
        """Admit, tokenize and queue one request; the stream of its reply events. The answer's id is
        `id_prefix` (default chatcmpl- or cmpl-) and the request id. A `background` request replies to
        `batch-results` instead (ingress/api/responses/background_replies.py) and nobody here waits for it: its stream is
        returned already ended, its edge reservation released (streams' quota still holds it)."""
        model = self.resolve_model(caller, body.model)
        if not chat and (body.echo or (body.best_of or 1) > 1 or body.suffix):
            raise APIError(400, "echo, best_of > 1 and suffix are not supported.", code="unsupported_parameter")
        if body.priority not in caller.tenant["allowed_priorities"]:
            raise APIError(403, f"Your plan does not allow priority '{body.priority}'.", code="priority_not_allowed",
                           param="priority")
        spec = structured_spec(body) if chat else None
        # The request and its concurrency slot are counted before the expensive part (tokenizing), so
        # a tenant cannot spend the shared tokenizer pool beyond its limits; its tokens follow below.
        request_id = uuid.uuid4().hex
        reservation = self.admission.admit(caller, request_id, 0)
        try:
            prompt_ids, max_tokens = await self._tokenize(caller, model, body, chat, spec)
            reserved = len(prompt_ids) + max_tokens * body.n
            self.admission.grow(reservation, reserved)
        except BaseException:
            self.admission.release(reservation)
            raise
        now_ms = arrived_ms
        timeout_s = body.timeout or caller.tenant["default_deadline_s"]
        record = inference_requested(
            request_id=request_id, tenant=caller.tenant, body=body, chat=chat, model=body.model,
            prompt_token_ids=prompt_ids, max_tokens=max_tokens, seed=random.getrandbits(62), priority=body.priority,
            arrived_at_ms=now_ms, deadline_ms=now_ms + int(timeout_s * 1000),
            reply_topic=topics.BATCH_RESULTS.name if background else topics.REPLIES.name,
            reply_partition=background_partition(request_id) if background else self.settings.reply_partition,
            api_key_id=caller.key_id, reply_incarnation=None if background else self.incarnation)
        prefix = id_prefix or ("chatcmpl-" if chat else "cmpl-")
        view = RequestView(response_id=prefix + request_id, model=body.model, chat=chat, n=body.n,
                           prompt_tokens=len(prompt_ids),
                           tool_call_prefix=f"call_{request_id[:16]}" if spec and spec["type"] == "tool_calls" else None)
        queue = asyncio.Queue() if background else self.router.register(request_id)
        try:
            codec.encode("InferenceRequested", record)
        except Exception as exc:  # a value the schema cannot carry slipped past validation
            self.router.unregister(request_id)
            self.admission.release(reservation)
            raise APIError(400, f"A parameter is out of range: {type(exc).__name__}.", code="invalid_value") from None
        try:
            await self.producer.send(topics.REQUESTS.name, caller.tenant_id, "InferenceRequested", record)
        except Exception:
            # The cause is logged here; the client gets no internal detail (broker names, addresses).
            log.exception("request %s could not be queued", request_id)
            self.router.unregister(request_id)
            self.admission.release(reservation)
            raise APIError(503, "The request could not be queued. Try again shortly.", code="queue_unavailable",
                           headers={"Retry-After": "1"}) from None
        stream = RequestStream(self, request, record, view, queue, reservation, timeout_s + REPLY_GRACE_S)
        if background:
            stream.finish(cancelled=False)
        return stream


def body_limit_for(path: str) -> tuple[int, str]:
    """Uploads may be as large as a batch file (plus the multipart framing); everything else is JSON."""
    if path.rstrip("/") == "/v1/files":
        return MAX_FILE_BYTES + 65536, "file_too_large"
    return MAX_BODY_BYTES, "request_too_large"


def _answer_errors_in_openai_format(app: FastAPI, ingress: Ingress) -> None:
    app.add_middleware(BodyLimit, limit_for=body_limit_for)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        ingress.metrics.rejections.labels(str(exc.status), exc.code or exc.error_type).inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException):
        # Unknown paths (404) and wrong methods (405) answer in the OpenAI format like every other error.
        message = {404: "Unknown path.", 405: "Method not allowed on this path."}.get(exc.status_code, str(exc.detail))
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # RFC 9110: a 405 names the methods the path does allow
            allowed = {m for route in app.routes if getattr(route, "path_regex", None) is not None
                       and route.path_regex.match(request.url.path) for m in (getattr(route, "methods", None) or ())}
            headers["Allow"] = ", ".join(sorted(allowed))
        return APIError(exc.status_code, message, code={404: "unknown_url", 405: "method_not_allowed"}.get(
            exc.status_code), headers=headers).response()

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(_request: Request, exc: RequestValidationError):
        # Query and path parameters FastAPI validates itself (bodies are parsed by `Ingress.parse`).
        err = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
        return APIError(400, f"Invalid value for '{param}': {err.get('msg', 'invalid')}.", code="invalid_value",
                        param=param).response()

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, "The server had an error while processing your request.").response()


def create_admin_app(ingress: Ingress) -> FastAPI:
    """The operators' listener (tenants, keys, quota views, /docs), served beside the public one by
    the same process; it binds to loopback unless told otherwise (docs/security.md)."""
    app = FastAPI(title="tokenmill admin", version="0.1.0")
    document_contract(app)
    app.state.ingress = ingress
    _answer_errors_in_openai_format(app, ingress)
    app.include_router(admin_router(ingress))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return Response(generate_latest(ingress.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def create_app(settings: IngressSettings | None = None) -> FastAPI:
    ingress = Ingress(settings or IngressSettings())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await ingress.start()
        yield
        await ingress.stop()

    # The public listener carries no admin routes and no /docs (the admin listener has them); its
    # OpenAPI document describes the client API only.
    app = FastAPI(title="tokenmill", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    document_contract(app)
    app.state.ingress = ingress
    _answer_errors_in_openai_format(app, ingress)
    app.include_router(batch_router(ingress))
    app.include_router(usage_router(ingress))
    app.include_router(responses_router(ingress))

    @app.get("/health")
    async def health():
        return {"status": "ok", "reply_partition": ingress.settings.reply_partition}

    @app.get("/v1/models")
    async def list_models(request: Request):
        ingress.authenticate(request)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": m.created, "owned_by": "tokenmill",
             "max_model_len": m.max_model_len} for name, m in ingress.models.items()]}

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest), responses=STREAMABLE)
    async def chat_completions(request: Request):
        return await ingress.handle(request, chat=True)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest), responses=STREAMABLE)
    async def completions(request: Request):
        return await ingress.handle(request, chat=False)

    return app
