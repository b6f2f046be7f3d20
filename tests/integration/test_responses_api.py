"""The Responses API through the official openai SDK, on the real stack with two ingress processes: plain and
streamed responses, conversations continued through the other process from the events on `responses`,
tenant isolation, deletion, `store: false`, and bad input answered in the OpenAI error format."""
from __future__ import annotations

import json
import signal
import time

from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from ingress.api.responses.finalizer import GROUP_ID as FINALIZER_GROUP
from schemas import topics
from tests.integration.conftest import MODEL_NAME
from tests.integration.kafka_probe import read_to_end, wait_committed_past, wait_for_events
from tests.integration.processes import Service, free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

LONG = " ".join(f"word{i}" for i in range(40))


@pytest.fixture(scope="module")
def other_ingress(stack):
    """A second ingress process (its own reply partition), and a client of the stack's tenant on it."""
    port = free_port()
    service = Service("responses-ingress-b", ["serve", "ingress", "--port", str(port), "--reply-partition", "1",
                                              "--admin-port", str(free_port())],
                      stack.env, stack.services["worker"].log_path.parent).start()
    try:
        service.wait_http(f"http://127.0.0.1:{port}/health")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=stack.api_key, max_retries=3)
    finally:
        service.stop()


def test_a_response_through_the_sdk_with_and_without_instructions(sdk_client):
    plain = sdk_client.responses.create(model=MODEL_NAME, input="hello there", max_output_tokens=6)
    assert plain.id.startswith("resp_") and plain.object == "response"
    assert plain.status in ("completed", "incomplete")
    assert isinstance(plain.output_text, str) and plain.output[0].role == "assistant"
    assert 1 <= plain.usage.output_tokens <= 6
    if plain.status == "incomplete":
        assert plain.incomplete_details.reason == "max_output_tokens" and plain.usage.output_tokens == 6
    instructed = sdk_client.responses.create(model=MODEL_NAME, input="hello there", max_output_tokens=6,
                                             instructions="Answer in one short sentence, always politely.")
    assert instructed.instructions.startswith("Answer")
    assert instructed.usage.input_tokens > plain.usage.input_tokens  # the instructions are part of the prompt


def test_a_streamed_response_has_ordered_typed_events_whose_deltas_make_the_text(sdk_client):
    events = list(sdk_client.responses.create(model=MODEL_NAME, input="tell me more", max_output_tokens=12,
                                              stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == next(e.text for e in events if e.type == "response.output_text.done")
    assert final.usage.output_tokens >= 1
    assert sdk_client.responses.retrieve(final.id).output_text == deltas  # stored at the end of the stream


def test_a_conversation_continues_through_another_ingress_and_reuses_the_cached_history(sdk_client, other_ingress):
    first = sdk_client.responses.create(model=MODEL_NAME, input=LONG, max_output_tokens=8, temperature=0)
    second = other_ingress.responses.create(model=MODEL_NAME, input="and then?", max_output_tokens=8,
                                            previous_response_id=first.id, temperature=0)
    assert second.previous_response_id == first.id
    # the whole conversation is the prompt (and is billed as such), its earlier turn mostly from the cache
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    third = sdk_client.responses.create(model=MODEL_NAME, input="and finally?", max_output_tokens=4,
                                        previous_response_id=second.id, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens
    for client in (sdk_client, other_ingress):
        assert client.responses.retrieve(second.id).output_text == second.output_text
    items = other_ingress.responses.input_items.list(first.id, order="asc")
    assert [i.role for i in items.data] == ["user"] and items.data[0].content[0].text == LONG


def test_another_tenant_can_neither_read_nor_continue_a_response(stack, sdk_client):
    mine = sdk_client.responses.create(model=MODEL_NAME, input="private", max_output_tokens=2)
    other_key = stack.issue_tenant(f"responses-other-{int(time.time())}")
    other = openai.OpenAI(base_url=stack.base_url, api_key=other_key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as err:
        other.responses.create(model=MODEL_NAME, input="go on", previous_response_id=mine.id)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    assert sdk_client.responses.retrieve(mine.id).id == mine.id  # untouched


def test_deleted_and_unstored_responses_are_gone_everywhere(sdk_client, other_ingress):
    kept = sdk_client.responses.create(model=MODEL_NAME, input="remember me", max_output_tokens=2)
    assert other_ingress.responses.retrieve(kept.id).id == kept.id
    sdk_client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        sdk_client.responses.retrieve(kept.id)
    deadline = time.monotonic() + 10
    while True:  # the other process learns of the deletion from `responses`
        try:
            other_ingress.responses.retrieve(kept.id)
        except openai.NotFoundError:
            break
        assert time.monotonic() < deadline, "the deletion never reached the other ingress"
    unstored = sdk_client.responses.create(model=MODEL_NAME, input="forget me", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        sdk_client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body, status, param", [
    ({"input": [{"role": "user"}]}, 400, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "previous_response_id": "resp_doesnotexist"}, 404, "previous_response_id"),
    ({"input": "hi", "background": True, "store": False}, 400, "store"),
    ({"input": "word " * 5000}, 413, "input"),
])
def test_bad_input_gets_an_openai_error_naming_the_parameter(stack, body, status, param):
    r = httpx.post(f"{stack.base_url}/responses", json={"model": MODEL_NAME, **body}, timeout=30,
                   headers={"Authorization": f"Bearer {stack.api_key}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["message"]


def test_a_background_response_is_queued_and_polled_to_its_end_on_another_ingress(sdk_client, other_ingress):
    created = sdk_client.responses.create(model=MODEL_NAME, input="take your time", max_output_tokens=8,
                                          background=True)
    assert created.background and created.status == "queued" and created.output == []
    deadline = time.monotonic() + 60
    while True:
        polled = other_ingress.responses.retrieve(created.id)
        if polled.status in ("completed", "incomplete"):
            break
        assert polled.status in ("queued", "in_progress"), polled.status
        assert time.monotonic() < deadline, "the background response never finished"
    assert polled.output_text and 1 <= polled.usage.output_tokens <= 8
    assert sdk_client.responses.retrieve(created.id).output_text == polled.output_text


def test_a_background_response_is_written_final_once_without_anyone_polling_it(sdk_client):
    """Its RequestCompleted makes the finalizer write the final record: nobody needs to poll in time (its
    reply events leave `batch-results` after 7 days), and no reader writes it again."""
    created = sdk_client.responses.create(model=MODEL_NAME, input="nobody will ask", max_output_tokens=6,
                                          background=True)
    def its_writes(e):
        return e.record.get("response_id") == created.id

    final = wait_for_events(topics.RESPONSES.name, lambda e: its_writes(e) and e.record["status"] != "queued",
                            timeout=30)[0].record
    # once the finalizers have committed past its completion, none of them is handed it again: what
    # `responses` holds then is every write there will be
    wait_committed_past(FINALIZER_GROUP, topics.USAGE.name,
                        lambda e: e.record.get("request_id") == final["request_id"])
    writes = read_to_end(topics.RESPONSES.name, its_writes)
    assert [w.record["status"] for w in writes] == ["queued", "incomplete"]  # created, then final: once
    assert final["output_tokens"] == 6 and final["output_text"]
    assert sdk_client.responses.retrieve(created.id).output_text == final["output_text"]


def _events(url: str, key: str, on_event=None, create: dict | None = None) -> list[dict]:
    """A response's SSE events until the stream ends (or `on_event` returns True): GET `url`, or POST
    `create` to it."""
    found = []
    with httpx.stream("POST" if create else "GET", url, json=create, headers={"Authorization": f"Bearer {key}"},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                found.append(json.loads(line[6:]))
                if on_event and on_event(found[-1]):
                    break
    return found


def test_a_background_stream_resumes_through_another_ingress_after_its_own_died(stack, sdk_client):
    port = free_port()
    doomed = Service("responses-ingress-c", ["serve", "ingress", "--port", str(port), "--reply-partition", "2",
                                             "--admin-port", str(free_port())],
                     stack.env, stack.services["worker"].log_path.parent).start()
    body = {"model": MODEL_NAME, "input": "a long story please", "max_output_tokens": 120, "temperature": 0.9,
            "seed": 4242}
    try:
        doomed.wait_http(f"http://127.0.0.1:{port}/health")
        deltas = []

        def kill_after_some_text(event):
            if event["type"] == "response.output_text.delta":
                deltas.append(event["delta"])
            if len(deltas) >= 15:
                doomed.kill(signal.SIGKILL)
                return True
            return False

        # created and streamed in one call; resumed below with GET, as the SDK's `retrieve(stream=True)` does
        first = _events(f"http://127.0.0.1:{port}/v1/responses", stack.api_key, kill_after_some_text,
                        create={**body, "background": True, "stream": True})
    finally:
        doomed.stop()
    created = first[0]["response"]
    assert first[0]["type"] == "response.created" and created["background"] is True and created["status"] == "queued"
    last = first[-1]["sequence_number"]
    assert [e["sequence_number"] for e in first] == list(range(last + 1))
    rest = _events(f"{stack.base_url}/responses/{created['id']}?stream=true&starting_after={last}", stack.api_key)
    assert [e["sequence_number"] for e in rest] == list(range(last + 1, last + 1 + len(rest)))
    assert rest[-1]["type"] in ("response.completed", "response.incomplete")
    text = "".join(deltas) + "".join(e["delta"] for e in rest if e["type"] == "response.output_text.delta")
    assert text == rest[-1]["response"]["output"][0]["content"][0]["text"]
    assert text == sdk_client.responses.retrieve(created["id"]).output_text
    # the same seed in the foreground (`seed` is an extension: the SDK sends it as an extra field)
    undisturbed = sdk_client.responses.create(**{k: v for k, v in body.items() if k != "seed"},
                                              extra_body={"seed": body["seed"]})
    assert text == undisturbed.output_text


def test_a_background_response_can_be_cancelled(sdk_client):
    # ignore_eos (an extension): the random model may end on a stop before the cancel, and a response that
    # ended is answered as it ended (test below)
    created = sdk_client.responses.create(model=MODEL_NAME, input="go on forever", max_output_tokens=1500,
                                          background=True, extra_body={"ignore_eos": True})
    cancelled = sdk_client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert sdk_client.responses.retrieve(created.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # a foreground response cannot be
        sdk_client.responses.cancel(sdk_client.responses.create(model=MODEL_NAME, input="hi",
                                                                max_output_tokens=2).id)


def test_cancelling_a_response_that_already_finished_leaves_it_finished_with_its_output(sdk_client):
    raw = sdk_client.responses.with_raw_response.create(model=MODEL_NAME, input="say something short",
                                                        max_output_tokens=4, background=True)
    created, request_id = raw.parse(), raw.headers["x-request-id"]
    # Nobody polls it, so its stored record still says `queued` once its last reply event is on the topic.
    ended = wait_for_events(topics.BATCH_RESULTS.name, lambda e: e.name == "ReplyBatch" and any(
        item["request_id"] == request_id and item["finish_reason"] for item in e.record["items"]), timeout=60)
    assert ended, "the background response never finished"
    answered = sdk_client.responses.cancel(created.id)
    assert answered.status in ("completed", "incomplete"), answered.status
    assert answered.output_text and 1 <= answered.usage.output_tokens <= 4
    kept = sdk_client.responses.retrieve(created.id)
    assert (kept.status, kept.output_text) == (answered.status, answered.output_text)
    assert sdk_client.responses.cancel(created.id).status == answered.status  # and again: unchanged


class Ticket(BaseModel):
    title: str = Field(max_length=8)
    severity: Literal["low", "high", "critical"]
    estimate_hours: int = Field(ge=0, le=99)


def test_text_format_json_schema_parses_into_the_callers_model(sdk_client):
    parsed = 0
    for seed in range(4):
        answer = sdk_client.responses.parse(model=MODEL_NAME, input="File a ticket for the broken login page.",
                                            text_format=Ticket, max_output_tokens=100, extra_body={"seed": seed})
        if answer.status != "completed":
            continue  # cut by max_output_tokens
        assert isinstance(answer.output_parsed, Ticket)
        parsed += 1
    assert parsed >= 3
    assert sdk_client.responses.retrieve(answer.id).text.format.type == "json_schema"
    r = httpx.post(f"{sdk_client.base_url}responses", headers={"Authorization": f"Bearer {sdk_client.api_key}"},
                   json={"model": MODEL_NAME, "input": "x", "text": {"format": {
                       "type": "json_schema", "name": "bad", "schema": {"type": "strng"}}}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 12}}}}


def test_function_tools_are_called_and_their_results_continue_the_conversation(sdk_client):
    first = sdk_client.responses.create(model=MODEL_NAME, input="What is the weather in Oslo?", tools=[WEATHER],
                                        tool_choice="required", parallel_tool_calls=False, max_output_tokens=150,
                                        extra_body={"seed": 5})
    assert first.status == "completed", first.incomplete_details
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and all(c.name == "get_weather" and set(json.loads(c.arguments)) == {"city"} for c in calls)
    assert first.tools[0].name == "get_weather"
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
    second = sdk_client.responses.create(model=MODEL_NAME, previous_response_id=first.id, max_output_tokens=4,
                                         input=results)
    alone = sdk_client.responses.create(model=MODEL_NAME, max_output_tokens=4, input=results)
    # the question and the call it made are in the prompt (tools are not carried over, as in OpenAI's API)
    assert second.usage.input_tokens > alone.usage.input_tokens + 10
    events = list(sdk_client.responses.create(model=MODEL_NAME, input="What is the weather in Oslo?",
                                              tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                              max_output_tokens=150, stream=True, extra_body={"seed": 5}))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]  # the same seed, streamed
    assert [e.sequence_number for e in events] == list(range(len(events)))
