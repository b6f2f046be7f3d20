"""A worker killed mid-stream: another worker regenerates the request from its seed, the client
gets exactly the text an undisturbed run gives (no duplicate, no gap), and it is billed once."""
import signal
import time

import pytest

from schemas import topics
from tests.integration.faults import stream_chunks, stream_completion
from tests.integration.kafka_probe import wait_for_events
from tests.integration.processes import Service

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.faults]

MODEL = "tiny"


def _stream_tool_calls(stack, body, on_token=None):
    """A streamed chat answer with tools, rebuilt as an OpenAI client rebuilds it."""
    content, calls, chunks, finish, request_id = [], {}, 0, None, None
    for request_id, chunk in stream_chunks(stack, "/chat/completions", body):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            for piece in delta.get("tool_calls") or []:
                entry = calls.setdefault(piece["index"], {"id": piece.get("id"), "name": None, "arguments": ""})
                entry["name"] = piece["function"].get("name") or entry["name"]
                entry["arguments"] += piece["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
            chunks += 1
            if on_token:
                on_token(request_id, chunks)
    return request_id, ("".join(content), [calls[i] for i in sorted(calls)]), finish


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["key", "limit"],
    "properties": {"key": {"type": "string", "maxLength": 12}, "limit": {"type": "integer", "minimum": 1,
                                                                         "maximum": 500}}}}}
CASES = {
    "completion": (stream_completion, {"model": MODEL, "prompt": "once upon a time", "max_tokens": 400, "temperature": 0.9,
                             "seed": 1234, "ignore_eos": True}, "length", 400),
    # a constrained answer: the resuming worker replays the streamed tokens into a fresh matcher
    "tool calls": (_stream_tool_calls, {"model": MODEL, "messages": [{"role": "user", "content": "look it up"}],
                                        "tools": [TOOL], "tool_choice": "required", "max_tokens": 300,
                                        "temperature": 0.9, "seed": 99}, None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_worker_killed_mid_stream_is_invisible_to_the_client(stack, tiny_model_dir, case):
    stream, body, expected_finish, expected_tokens = CASES[case]
    spare = Service("worker-spare", ["serve", "worker", "--model", str(tiny_model_dir), "--model-name", MODEL,
                                     "--worker-id", "test-worker-spare", "--threads", "1", "--kv-cache-mb", "64"],
                    stack.env, stack.services["worker"].log_path.parent).start()
    try:
        spare.wait_log("assigned work partitions")
        _, reference, ref_finish = stream(stack, body)

        workers = {"worker": stack.services["worker"], "worker-spare": spare}
        killed = {}

        def kill_owner(request_id, tokens):
            if killed or tokens < 20:
                return
            for name, service in workers.items():
                if f"started request {request_id}" in service.log():
                    service.kill(signal.SIGKILL)
                    killed[name] = time.monotonic()
                    return

        request_id, answer, finish = stream(stack, body, on_token=kill_owner)
        assert killed, "the request finished before a worker could be killed"
        if case == "tool calls":  # call ids are per request; everything else must be identical
            for call in answer[1] + reference[1]:
                call.pop("id")
            assert answer[1], "the answer made no tool call"
        assert answer == reference
        assert finish == ref_finish
        if expected_finish:
            assert finish == expected_finish
        billed = wait_for_events(topics.USAGE.name, lambda e: e.record["request_id"] == request_id, count=2,
                                 timeout=8)
        assert len(billed) == 1
        if expected_tokens:
            assert billed[0].record["completion_tokens"] == expected_tokens
    finally:
        spare.stop()
        main = stack.services["worker"]
        if main.proc.poll() is not None:  # leave the session stack with a worker
            main.start()
            main.wait_log("serving")
