"""Event record types, generated from schemas/avro/*.avsc by `python -m schemas.record_types`:
do not edit by hand (tests/schemas/test_record_types.py checks it is current)."""
from __future__ import annotations

from typing import TypedDict


class AdapterChunk(TypedDict):
    """One piece of a registered adapter's adapter_model.safetensors, keyed <tenant>/<name>@<version>#<index>, in its manifest's partition."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    adapter_id: str
    version: str
    index: int
    chunk_count: int
    data: bytes


class AdapterManifest(TypedDict):
    """A registered LoRA adapter on the compacted `adapters` topic, keyed <tenant>/<name>; a tombstone deletes it. Its files are the AdapterChunk records before it in the same partition."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    adapter_id: str
    tenant_id: str
    name: str
    base_model: str
    version: str
    rank: int
    target_modules: list[str]
    adapter_config: str
    weights_bytes: int
    weights_sha256: str
    chunk_count: int
    created_ms: int


class CapacityAdvertised(TypedDict):
    """A worker's free capacity; streams turns it into release credits."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    worker_id: str
    incarnation: str
    model: str
    free_slots: int
    free_kv_blocks: int
    total_slots: int
    total_kv_blocks: int
    block_size: int
    running: int
    waiting: int
    consumed_total: int
    stopping: bool
    work_partitions: list[int]
    cached_blocks: None | bytes
    resident_adapters: list[str]


class DeadLetter(TypedDict):
    """A message some consumer could not decode or process, with the reason."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    source_topic: str
    source_partition: int
    source_offset: int
    consumer: str
    reason: str
    key: None | bytes
    value: None | bytes


class SamplingSpec(TypedDict):
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: None | int
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    n: int
    logprobs: None | int


class ResumePoint(TypedDict):
    completion_token_ids: list[int]
    text_chars: int
    preemptions: int
    started_at_ms: None | int
    first_token_at_ms: None | int
    cached_tokens: int


class AdapterRef(TypedDict):
    adapter_id: str
    name: str
    version: str


class InferenceRequested(TypedDict):
    """An authenticated, edge-admitted request. Also the payload of `work` once streams releases it."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    tenant_id: str
    model: str
    endpoint: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    priority: str
    arrived_at_ms: int
    deadline_ms: int
    reply_topic: str
    reply_partition: int
    reserved_tokens: int
    cache_salt: None | str
    api_key_id: None | str
    batch_id: None | str
    custom_id: None | str
    released_at_ms: None | int
    reply_incarnation: None | str
    resume: None | ResumePoint
    response_format: None | str
    adapter: None | AdapterRef


class IngressHeartbeat(TypedDict):
    """An ingress process says it still reads its reply address; workers cancel requests whose reader is gone."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    reply_topic: str
    reply_partition: int
    incarnation: str
    interval_ms: int
    stopping: bool


class PreemptRequested(TypedDict):
    """streams asks the worker running request_id to give up its slot (on `preemptions`)"""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    tenant_id: str
    model: str
    reason: str
    for_request_id: None | str


class QuotaState(TypedDict):
    """Streams' authoritative usage per tenant, published for the edge."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    tenant_id: str
    window_start_ms: int
    window_ms: int
    requests_in_window: int
    tokens_in_window: int
    in_flight_requests: int
    in_flight_tokens: int
    month: str
    month_tokens_used: int


class TokenUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class ReplyItem(TypedDict):
    request_id: str
    choice_index: int
    first_token_index: int
    token_ids: list[int]
    text: str
    logprobs: None | list[float]
    finish_reason: None | str
    usage: None | TokenUsage


class ReplyBatch(TypedDict):
    """New tokens of every sequence bound to one reply address in one engine step."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    worker_id: None | str
    items: list[ReplyItem]


class RequestCancelled(TypedDict):
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    tenant_id: str
    reason: str


class RequestCompleted(TypedDict):
    """Exactly one per admitted request, whatever its outcome; the billing ledger's source."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    tenant_id: str
    model: str
    status: str
    finish_reason: None | str
    priority: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reserved_tokens: int
    arrived_at_ms: int
    started_at_ms: None | int
    first_token_at_ms: None | int
    finished_at_ms: int
    ttft_ms: None | float
    tpot_ms: None | float
    queue_ms: None | float
    worker_id: None | str
    api_key_id: None | str
    batch_id: None | str
    adapter: None | str


class RequestError(TypedDict):
    """A request that ends without (more) tokens: rejected, shed or failed."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    status_code: int
    error_type: str
    code: None | str
    message: str
    retry_after_s: None | float


class RequestPreempted(TypedDict):
    """a worker stopped request_id and freed its slot (on `capacity`, keyed by worker id, ahead of the advert that shows the slot)"""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    tenant_id: str
    model: str
    worker_id: str
    incarnation: str
    reason: str
    completion_token_ids: list[int]
    text_chars: int
    started_at_ms: None | int
    first_token_at_ms: None | int
    cached_tokens: int


class StoredResponse(TypedDict):
    """A stored Responses API response (POST /v1/responses with store: true), keyed by its id on the compacted `responses` topic; any ingress rebuilds a conversation from these. A deleted response is a record with deleted: true and no content."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    response_id: str
    tenant_id: str
    deleted: bool
    model: str
    created_at: int
    status: str
    incomplete_reason: None | str
    previous_response_id: None | str
    instructions: None | str
    input_items_json: str
    output_text: str
    metadata_json: str
    max_output_tokens: None | int
    temperature: None | float
    top_p: None | float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    background: bool
    reply_partition: int
    created_at_ms: int
    error_message: None | str
    text_json: str
    output_calls_json: str
    tools_json: str
    tool_choice_json: str


class ApiKeyRecord(TypedDict):
    key_id: str
    prefix: str
    hash: str
    created_ms: int
    revoked_ms: None | int


class TenantSnapshot(TypedDict):
    """Full state of one tenant; the compacted `tenants` topic keeps the latest per tenant id."""
    event_id: str
    request_id: None | str
    schema_version: int
    timestamp_ms: int
    tenant_id: str
    name: str
    plan: str
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int
    monthly_token_budget: int
    allowed_models: list[str]
    allowed_priorities: list[str]
    fairness_weight: float
    default_deadline_s: float
    max_queued: int
    share_prefix_cache: bool
    disabled: bool
    api_keys: list[ApiKeyRecord]
