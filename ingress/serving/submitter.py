"""Admit, tokenize and queue one request (an HTTP chat or text completion, or a Responses API turn): the
one submission path every surface shares. Each request becomes one `InferenceRequested` event on
`requests`, acknowledged by the broker before the client is answered."""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from starlette.requests import Request

from lora.adapters import AdapterCatalog
from structured_outputs.grammars import GrammarBusy, GrammarError
from http_api.openai_errors import APIError
from ingress.serving.prompts import PromptKind, completion_length
from ingress.serving.request_builder import inference_requested
from ingress.serving.request_stream import LiveReplies, RequestStream, StreamServices
from ingress.serving.served_model import ServedModel
from ingress.tenancy.admission import Reservation
from ingress.tenancy.directory import Caller
from schemas import codec, topics

log = logging.getLogger("tokenmill.ingress")

# Prompts of one tenant tokenized at the same time (the shared pool has about cores + 4 threads).
TOKENIZE_PER_TENANT = 2
REPLY_GRACE_S = 30.0


@dataclass(frozen=True)
class ReplyAddress:
    """Where a request's reply events go: this process's own partition of `replies` (its incarnation
    names the process that waits), or a `batch-results` partition nobody waits on."""
    topic: str
    partition: int
    incarnation: str | None


def now_ms() -> int:
    return int(time.time() * 1000)


class Submitter:
    def __init__(self, models: dict[str, ServedModel], services: StreamServices, reply_to: ReplyAddress,
                 default_max_tokens: int, adapters: AdapterCatalog | None = None):
        self.models, self.services, self.reply_to = models, services, reply_to
        self.adapters = adapters or AdapterCatalog()
        self.default_max_tokens = default_max_tokens
        self._tokenizing: dict[str, asyncio.Semaphore] = {}

    def resolve_model(self, caller: Caller, name: str) -> ServedModel:
        return self.resolve(caller, name)[0]

    def resolve(self, caller: Caller, name: str) -> tuple[ServedModel, str, dict[str, str] | None]:
        """The served model a model id names, its name, and the caller's LoRA adapter (an AdapterRef) when
        the id is `<base>:<adapter>`. Another tenant's adapter is not found, exactly like an unknown model."""
        base, adapter = name, None
        model = self.models.get(name)
        if model is None:
            manifest = self.adapters.resolve(caller.tenant_id, name)
            if manifest is not None:
                base = manifest["base_model"]
                model = self.models.get(base)
                adapter = {"adapter_id": manifest["adapter_id"], "name": manifest["name"],
                           "version": manifest["version"]}
        if model is None:
            raise APIError(404, f"The model '{name}' does not exist.", code="model_not_found", param="model")
        allowed = caller.tenant["allowed_models"]
        if allowed and name not in allowed and base not in allowed:
            raise APIError(403, f"Your plan does not include the model '{name}'.", code="model_not_allowed",
                           param="model")
        return model, base, adapter

    def _tokenizing_slot(self, tenant_id: str) -> asyncio.Semaphore:
        slot = self._tokenizing.get(tenant_id)
        if slot is None:
            slot = self._tokenizing[tenant_id] = asyncio.Semaphore(TOKENIZE_PER_TENANT)
        return slot

    async def _tokenize(self, caller: Caller, model: ServedModel, body, kind: PromptKind,
                        spec: dict | None) -> tuple[list[int], int]:
        """The prompt's token ids and the completion length, or a 413 if they cannot fit. A structured-
        output ``spec`` is compiled here too, under the same per-tenant slot (a tenant sending slow
        schemas holds its own slots, not everyone's), so a bad one costs no queueing and no GPU time."""
        if model.surely_too_long(kind.texts(body)):
            raise APIError(413, f"This model's maximum context length is {model.max_model_len} tokens, and the "
                                f"prompt is longer than that.", code="context_length_exceeded", param=kind.param)
        if spec is not None:
            try:  # a schema over the cost limits is refused before it costs a tokenizer thread
                model.grammars.refuse_costly(spec)
            except GrammarError as exc:
                raise APIError(400, str(exc), code="invalid_response_format", param=exc.param) from None
        # Tokenizing runs in a thread pool all tenants share: one tenant gets a few threads at a time.
        async with self._tokenizing_slot(caller.tenant_id):
            prompt_ids = await asyncio.to_thread(kind.token_ids, model, body)
            if spec is not None:
                await _compile(model, spec, caller.tenant_id)
        return prompt_ids, completion_length(model, prompt_ids, body.requested_max_tokens(), self.default_max_tokens,
                                             kind.param)

    async def _admitted(self, caller: Caller, model: ServedModel, body, kind: PromptKind, spec: dict | None,
                        request_id: str) -> tuple[Reservation, list[int], int]:
        # The request and its concurrency slot are counted before the expensive part (tokenizing), so
        # a tenant cannot spend the shared tokenizer pool beyond its limits; its tokens follow below.
        admission = self.services.admission
        reservation = admission.admit(caller, request_id, 0)
        try:
            prompt_ids, max_tokens = await self._tokenize(caller, model, body, kind, spec)
            admission.grow(reservation, len(prompt_ids) + max_tokens * body.n)
        except BaseException:
            admission.release(reservation)
            raise
        return reservation, prompt_ids, max_tokens

    async def submit(self, request: Request, caller: Caller, body, kind: PromptKind, arrived_ms: int,
                     id_prefix: str | None = None,
                     background_partition: Callable[[str], int] | None = None) -> RequestStream:
        """Admit, tokenize and queue one request; the stream of its reply events. The answer's id is
        `id_prefix` (default the prompt kind's) and the request id. A background request (one with a
        `background_partition`, of its request id) replies to `batch-results` instead and nobody here
        waits for it: its stream is returned already ended, its edge reservation released (streams'
        quota still holds it)."""
        model, base, adapter = self.resolve(caller, body.model)
        kind.refuse_unsupported(body)
        if body.priority not in caller.tenant["allowed_priorities"]:
            raise APIError(403, f"Your plan does not allow priority '{body.priority}'.", code="priority_not_allowed",
                           param="priority")
        spec = kind.constraint(body)
        request_id = uuid.uuid4().hex
        reservation, prompt_ids, max_tokens = await self._admitted(caller, model, body, kind, spec, request_id)
        background = background_partition is not None
        reply_to = (ReplyAddress(topics.BATCH_RESULTS.name, background_partition(request_id), None)
                    if background_partition is not None else self.reply_to)
        timeout_s = body.timeout or caller.tenant["default_deadline_s"]
        record = inference_requested(
            request_id=request_id, tenant=caller.tenant, body=body, chat=kind.chat, model=base,
            prompt_token_ids=prompt_ids, max_tokens=max_tokens, seed=random.getrandbits(62), priority=body.priority,
            arrived_at_ms=arrived_ms, deadline_ms=arrived_ms + int(timeout_s * 1000), reply_topic=reply_to.topic,
            reply_partition=reply_to.partition, api_key_id=caller.key_id, reply_incarnation=reply_to.incarnation,
            adapter=adapter)
        view = kind.view(response_id=(id_prefix or kind.id_prefix) + request_id, model=body.model, n=body.n,
                         prompt_tokens=len(prompt_ids),
                         tool_call_prefix=f"call_{request_id[:16]}" if spec and spec["type"] == "tool_calls" else None)
        queue = asyncio.Queue() if background else self.services.replies.register(request_id)
        await self._queue(caller, record, reservation)
        stream = RequestStream(LiveReplies(self.services, request, record, queue, reservation,
                                           timeout_s + REPLY_GRACE_S), view)
        if background:
            stream.finish(cancelled=False)
        return stream

    async def _queue(self, caller: Caller, record: dict, reservation: Reservation) -> None:
        """Put the request on `requests` (acknowledged), or give back what it holds and say why not."""
        request_id = record["request_id"]
        try:
            codec.encode("InferenceRequested", record)
        except Exception as exc:  # a value the schema cannot carry slipped past validation
            self._give_back(request_id, reservation)
            raise APIError(400, f"A parameter is out of range: {type(exc).__name__}.", code="invalid_value") from None
        try:
            await self.services.producer.send(topics.REQUESTS.name, caller.tenant_id, "InferenceRequested", record)
        except Exception:
            # The cause is logged here; the client gets no internal detail (broker names, addresses).
            log.exception("request %s could not be queued", request_id)
            self._give_back(request_id, reservation)
            raise APIError(503, "The request could not be queued. Try again shortly.", code="queue_unavailable",
                           headers={"Retry-After": "1"}) from None

    def _give_back(self, request_id: str, reservation: Reservation) -> None:
        self.services.replies.unregister(request_id)
        self.services.admission.release(reservation)


async def _compile(model: ServedModel, spec: dict, tenant_id: str) -> None:
    try:  # compile slots are shared fairly between tenants (structured_outputs/compile_pool.py)
        await asyncio.to_thread(model.grammars.compile, spec, tenant=tenant_id)
    except GrammarBusy as exc:
        raise APIError(503, str(exc), code="grammar_compiler_busy", headers={"Retry-After": "1"}) from None
    except GrammarError as exc:
        raise APIError(400, str(exc), code="invalid_response_format", param=exc.param) from None
