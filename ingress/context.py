"""What every route of an ingress process works with, made once by the composition root (app.py) and
reached by a route through the typed `Context` dependency (the app's state), never as a global."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from lora.adapters import AdapterFollower
from infra.config import ModelSpec, default_max_tokens, heartbeat_interval_s, key_secret, served_models
from ingress.kafka.heartbeat import Heartbeat
from ingress.kafka.reads import KafkaReads
from ingress.kafka.producer import AsyncProducer
from ingress.kafka.reply_router import ReplyRouter
from ingress.metrics import IngressMetrics
from ingress.serving.request_stream import StreamServices
from ingress.serving.served_model import ServedModel
from ingress.serving.submitter import ReplyAddress, Submitter
from ingress.tenancy.admission import EdgeAdmission, quota_state_follower
from ingress.tenancy.authentication import Authenticator
from ingress.tenancy.directory import TenantFollower
from ingress.tenancy.read_limits import ReadLimits
from schemas import topics


@dataclass
class IngressSettings:
    reply_partition: int = 0
    models: dict[str, ModelSpec] = field(default_factory=served_models)
    secret: bytes = field(default_factory=key_secret)
    process_id: str = field(default_factory=lambda: f"ingress-{uuid.uuid4().hex[:8]}")
    default_max_tokens: int = field(default_factory=default_max_tokens)
    heartbeat_interval_s: float = field(default_factory=heartbeat_interval_s)


class IngressContext:
    """The process's served models, tenant view, edge admission and Kafka bridge; `start` connects them."""

    def __init__(self, settings: IngressSettings):
        self.settings = settings
        self.models = {name: ServedModel(spec) for name, spec in settings.models.items()}
        self.metrics = IngressMetrics()
        self.tenants = TenantFollower(client_id=f"{settings.process_id}-tenants", dead_letters=True)
        # Registered LoRA adapters (manifests only): model ids <base>:<name> resolve for their own tenant.
        self.adapters = AdapterFollower(client_id=f"{settings.process_id}-adapters")
        self.authenticator = Authenticator(self.tenants.directory, settings.secret)
        self.admission = EdgeAdmission()
        self.quota_state = quota_state_follower(self.admission, settings.process_id)
        # Lookups' blocking Kafka reads (their own pool, off the tokenizer's) and what a tenant may hold of them.
        self.kafka_reads = KafkaReads(f"{settings.process_id}-lookups")
        self.read_limits = ReadLimits.from_env()
        # The process that waits on the reply partition: workers cancel what an older one left.
        self.incarnation = uuid.uuid4().hex[:16]
        # Made by `start` (they connect to Kafka, on the running loop); every route runs after it.
        self._producer: AsyncProducer | None = None
        self._replies: ReplyRouter | None = None
        self._heartbeat: Heartbeat | None = None
        self._submitter: Submitter | None = None

    @property
    def producer(self) -> AsyncProducer:
        assert self._producer is not None, "IngressContext.start() comes first"
        return self._producer

    @property
    def submitter(self) -> Submitter:
        assert self._submitter is not None, "IngressContext.start() comes first"
        return self._submitter

    async def start(self) -> None:
        settings = self.settings
        self._producer = producer = AsyncProducer(settings.process_id)
        self._replies = replies = ReplyRouter(settings.reply_partition, asyncio.get_running_loop())
        await asyncio.to_thread(replies.start)
        await asyncio.to_thread(self.tenants.start)
        await asyncio.to_thread(self.adapters.start)
        self.quota_state.start()
        services = StreamServices(self.metrics, self.admission, replies, producer)
        self._submitter = Submitter(self.models, services,
                                   ReplyAddress(topics.REPLIES.name, settings.reply_partition, self.incarnation),
                                   settings.default_max_tokens, adapters=self.adapters.catalog)
        self._heartbeat = Heartbeat(producer, settings.reply_partition, self.incarnation,
                                    settings.heartbeat_interval_s)
        self._heartbeat.start()

    async def stop(self) -> None:
        if self._heartbeat:
            self._heartbeat.stop()
        self.quota_state.stop(timeout=3)
        if self._replies:
            self._replies.stop()
        self.tenants.stop()
        self.adapters.stop()
        uploads = getattr(self, "adapter_uploads", None)  # the admin API's (ingress/admin/adapter_uploads.py)
        if uploads is not None:
            uploads.close()
        if self._producer:
            self._producer.close()
        self.kafka_reads.close()


def context_of(request: Request) -> IngressContext:
    return request.app.state.context


Context = Annotated[IngressContext, Depends(context_of)]
