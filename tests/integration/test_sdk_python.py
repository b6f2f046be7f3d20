"""The official `openai` Python SDK on what the rest of the suite does not already use it for (the suite speaks
to the stack through it throughout): `models.retrieve`, and the SDK's error types as it raises them itself,
401 AuthenticationError, 404 NotFoundError, and a 429 with Retry-After that it retries on its own. The same
checks as the Node and Go programs (tests/integration/sdk_programs.py)."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.conftest import MODEL_NAME
from tests.integration.sdk_programs import ROOMY

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
USER = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0, timeout=60)


def test_models_retrieve(client):
    model = client.models.retrieve(MODEL_NAME)
    assert (model.id, model.object, model.owned_by) == (MODEL_NAME, "model", "tokenmill") and model.created > 0
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"


def test_error_types(stack, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.base_url, api_key="tm-000000000000-nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=USER)
    assert missing.value.code == "model_not_found"


def test_a_429_with_retry_after_is_retried_by_the_sdk(stack):
    """The tenant may run one request at a time. One stream holds that slot; a second request is refused with
    429 and Retry-After, and the SDK retries it by itself. The hold ends when that first 429 has been seen."""
    key = stack.issue_tenant("sdk-python-single", **{**ROOMY, "max_concurrent": 1})
    holder = openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=60)
    hold = holder.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1500, stream=True,
                                          extra_body={"ignore_eos": True})
    next(iter(hold))  # the held request is running
    statuses = []

    def seen(response: httpx.Response) -> None:
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            hold.close()

    retrying = openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=5, timeout=60,
                             http_client=httpx.Client(event_hooks={"response": [seen]}))
    answer = retrying.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2)
    assert answer.object == "chat.completion"
    assert statuses[0] == 429 and statuses[-1] == 200, statuses
