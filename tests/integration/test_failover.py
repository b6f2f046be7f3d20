"""A worker killed mid-stream: another worker regenerates the request from its seed, the client
gets exactly the text an undisturbed run gives (no duplicate, no gap), and it is billed once."""
import json
import signal
import time

import httpx
import pytest

from schemas import topics
from tests.integration.kafka_probe import wait_for_events
from tests.integration.processes import Service

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.faults]

MODEL = "tiny"


def _stream(stack, body, on_token=None):
    text, tokens, finish = [], 0, None
    with httpx.stream("POST", f"{stack.base_url}/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {stack.api_key}"}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
                tokens += 1
                if on_token:
                    on_token(request_id, tokens)
    return request_id, "".join(text), finish


def test_worker_killed_mid_stream_is_invisible_to_the_client(stack, tiny_model_dir):
    spare = Service("worker-spare", ["serve", "worker", "--model", str(tiny_model_dir), "--model-name", MODEL,
                                     "--worker-id", "test-worker-spare", "--threads", "1", "--kv-cache-mb", "64"],
                    stack.env, stack.services["worker"].log_path.parent).start()
    try:
        spare.wait_log("assigned work partitions")
        body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 400, "temperature": 0.9, "seed": 1234,
                "ignore_eos": True}
        _, reference, ref_finish = _stream(stack, body)

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

        request_id, text, finish = _stream(stack, body, on_token=kill_owner)
        assert killed, "the request finished before a worker could be killed"
        assert text == reference
        assert finish == ref_finish == "length"
        billed = wait_for_events(topics.USAGE.name, lambda e: e.record["request_id"] == request_id, count=2,
                                 timeout=8)
        assert len(billed) == 1 and billed[0].record["completion_tokens"] == 400
    finally:
        spare.stop()
        main = stack.services["worker"]
        if main.proc.poll() is not None:  # leave the session stack with a worker
            main.start()
            main.wait_log("serving")
