"""The one InferenceRequested builder: what an HTTP request and a batch line both become."""
from ingress.protocol import ChatCompletionRequest, CompletionRequest
from ingress.serving.request_builder import inference_requested
from schemas import codec

TENANT = {"tenant_id": "acme", "share_prefix_cache": False}


def build(body, chat, tenant=TENANT, **extra):
    return inference_requested(request_id="r1", tenant=tenant, body=body, chat=chat, model=body.model,
                               prompt_token_ids=[1, 2, 3], max_tokens=10, seed=42, priority="interactive",
                               arrived_at_ms=1000, deadline_ms=61000, reply_topic="replies", reply_partition=3,
                               api_key_id="k", **extra)


def test_a_request_reserves_its_prompt_and_every_choices_completion():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "n": 2})
    record = build(body, chat=True)
    assert record["reserved_tokens"] == 3 + 10 * 2
    assert record["endpoint"] == "chat.completions" and record["sampling"]["n"] == 2
    assert record["sampling"]["seed"] == 42 and record["sampling"]["max_tokens"] == 10
    decoded = codec.decode(*codec.encode("InferenceRequested", record))  # valid against the schema
    assert decoded.record["reply_partition"] == 3


def test_the_prefix_cache_is_salted_per_tenant_unless_it_shares():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "seed": 7})
    own = build(body, chat=False)
    assert own["cache_salt"] == "acme" and own["endpoint"] == "completions"
    assert own["sampling"]["seed"] == 7  # the client's seed wins over the default
    shared = build(body, chat=False, tenant={**TENANT, "share_prefix_cache": True})
    assert shared["cache_salt"] is None


def test_a_batch_line_carries_its_batch_and_custom_id():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    record = build(body, chat=False, batch_id="batch_1", custom_id="line-7")
    assert (record["batch_id"], record["custom_id"], record["reply_incarnation"]) == ("batch_1", "line-7", None)
    codec.encode("InferenceRequested", record)
