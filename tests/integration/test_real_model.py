"""What tokenmill promises, shown on the real model `make up` serves (SmolLM2-135M-Instruct), through
the official openai SDK against the real stack: answers that are right, not only well-formed.

A small deliberate set: the rest of the suite keeps its fast tiny models. Every request is greedy, so
each answer is the model's single most likely one and the assertions read its content."""
from __future__ import annotations

import json
import signal

import openai
import pytest
from pydantic import BaseModel

from schemas import topics
from tests.integration.conftest import REAL_MODEL
from tests.integration.faults import stream_completion
from tests.integration.kafka_probe import wait_for_events
from tests.integration.processes import Service
from tests.support.ledger import ledger_rows

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def real_worker(stack, real_model_dir):
    worker = Service("worker-real-model", [
        "serve", "worker", "--model", str(real_model_dir), "--model-name", REAL_MODEL,
        "--worker-id", "test-worker-real-model", "--threads", "1", "--kv-cache-mb", "128"],
        stack.env, stack.services["worker"].log_path.parent).start()
    try:
        # loading 0.5 GB of float32 weights on a busy 2-core machine takes a while
        worker.wait_log("assigned work partitions", timeout=300)
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def client(stack, real_worker):
    return openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0, timeout=120)


def _ask(client, content: str, **options):
    return client.chat.completions.create(model=REAL_MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, **options)


def test_the_capital_of_france_is_paris(client):
    answer = _ask(client, "What is the capital of France?", max_tokens=24)
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"  # ended by the model's own EOS, not by max_tokens


class CapitalCity(BaseModel):
    country: str
    capital: str


def test_parse_gives_a_valid_on_topic_object(client):
    completion = client.chat.completions.parse(
        model=REAL_MODEL, response_format=CapitalCity, temperature=0, max_tokens=48,
        messages=[{"role": "user", "content": "What is the capital of France? Answer as JSON with the country "
                                              "and its capital."}])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, CapitalCity)
    assert parsed.country.lower() == "france" and parsed.capital == "Paris"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_required_tool_call_names_the_city_asked_about(client):
    answer = _ask(client, "What's the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
                  max_tokens=48)
    calls = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and calls
    assert calls[0].function.name == "get_weather"
    assert "Paris" in json.loads(calls[0].function.arguments)["city"]


def test_a_two_turn_responses_conversation_remembers_turn_one(client):
    first = client.responses.create(model=REAL_MODEL, temperature=0, max_output_tokens=32,
                                    input="My name is Alice. Please remember it.")
    second = client.responses.create(model=REAL_MODEL, temperature=0, max_output_tokens=24,
                                     previous_response_id=first.id, input="What is my name?")
    assert "Alice" in second.output_text
    alone = client.responses.create(model=REAL_MODEL, temperature=0, max_output_tokens=24, input="What is my name?")
    assert "Alice" not in alone.output_text  # the name came from turn one, not from the question
    assert second.usage.input_tokens > first.usage.input_tokens  # the history was sent again, and billed


def _ledger_rows(stack, request_ids: list[str], timeout: float = 30) -> dict[str, dict]:
    return {row["request_id"]: row for row in ledger_rows(stack.billing_url, request_ids, timeout)}


def test_streamed_equals_whole_and_billed(stack, client):
    question = "Name three colours of the rainbow."
    whole = _ask(client, question, max_tokens=32)
    text, chunks, usage, stream_id = "", 0, None, None
    for chunk in _ask(client, question, max_tokens=32, stream=True, stream_options={"include_usage": True}):
        stream_id = chunk.id
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            chunks += bool(choice.delta.content)
    assert text == whole.choices[0].message.content and text.strip()
    assert usage.completion_tokens == whole.usage.completion_tokens
    ids = [whole.id.removeprefix("chatcmpl-"), stream_id.removeprefix("chatcmpl-")]
    rows = _ledger_rows(stack, ids)
    assert {i: rows[i]["completion_tokens"] for i in ids} == {i: usage.completion_tokens for i in ids}
    assert {rows[i]["model"] for i in ids} == {REAL_MODEL}


@pytest.mark.faults
def test_a_worker_sigkilled_mid_stream_still_gives_the_undisturbed_text(stack, real_worker):
    """Sampled, not greedy: the restarted worker regenerates the request from its seed, and the client
    gets exactly the text an undisturbed run gives, billed once."""
    body = {"model": REAL_MODEL, "prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 32,
            "temperature": 0.8, "seed": 1234, "ignore_eos": True}
    _, undisturbed, _ = stream_completion(stack, body)
    killed = []

    def kill_and_restart(request_id, tokens):
        if tokens == 8 and not killed:
            real_worker.kill(signal.SIGKILL)
            killed.append(request_id)
            real_worker.start()  # the same worker id: its work partitions come back, the request is redelivered

    request_id, text, finish = stream_completion(stack, body, on_token=kill_and_restart)
    assert killed == [request_id]
    assert text == undisturbed and finish == "length"
    billed = wait_for_events(topics.USAGE.name, lambda e: e.record["request_id"] == request_id, count=2, timeout=8)
    assert [e.record["completion_tokens"] for e in billed] == [32]
