"""A conversation of the Responses API lives in Kafka, not in any process: every service of the stack
stopped and started again between two turns. On a stack of the module's own (marked `faults`), since
it stops them all."""
from __future__ import annotations

import pytest

from tests.integration.conftest import MODEL_NAME
from tests.support.waiting import wait_key_accepted

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.faults]

LONG = " ".join(f"word{i}" for i in range(40))


def test_a_conversation_continues_after_every_service_restarted(stack, sdk_client):
    first = sdk_client.responses.create(model=MODEL_NAME, input=LONG, max_output_tokens=4, temperature=0)
    for service in stack.services.values():
        service.stop()
    for service in stack.services.values():
        service.start()
    stack.services["worker"].wait_log("serving")
    stack.services["streams"].wait_log("scheduler active")
    stack.services["ingress"].wait_http(stack.base_url.removesuffix("/v1") + "/health")
    stack.services["billing"].wait_http(f"{stack.billing_url}/health")
    # the restarted ingress reads the tenant (and its key) back from `tenants`
    wait_key_accepted(stack.base_url, stack.api_key, timeout=30)
    second = sdk_client.responses.create(model=MODEL_NAME, input="and then?", max_output_tokens=4,
                                         previous_response_id=first.id, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert sdk_client.responses.retrieve(first.id).output_text == first.output_text
