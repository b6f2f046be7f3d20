"""An ingress process dies mid-stream: its requests are cancelled and their slots freed."""
import signal
import time

import httpx
import pytest

from schemas import topics
from tests.integration.kafka_probe import wait_for_events
from tests.integration.processes import Service, free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.faults]

MODEL = "tiny"


def test_killed_ingress_gets_its_requests_cancelled(stack):
    port = free_port()
    # Beats every 0.1 s, so workers give up on it 1 s after it stops (10 missed beats), plus up to
    # 0.25 s until their view of the heartbeats is confirmed complete and 0.2 s until they look.
    env = {**stack.env, "TOKENMILL_HEARTBEAT_INTERVAL_S": "0.1"}
    doomed = Service("ingress-doomed", ["serve", "ingress", "--port", str(port), "--reply-partition", "2",
                                         "--admin-port", str(free_port())],
                     env, stack.services["ingress"].log_path.parent).start()
    try:
        doomed.wait_http(f"http://127.0.0.1:{port}/health")
        headers = {"Authorization": f"Bearer {stack.api_key}"}
        deadline = time.monotonic() + 10
        while httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # The tiny model writes 2000 tokens in ~1.5 s; six choices keep it busy for several seconds, longer
        # than a verdict takes even when a slow heartbeat read on a loaded machine adds the 3 s reconnect
        # grace (gpu_consumers/reply_readers.py). With two, a full `make test` saw it finish first.
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2000, "n": 6, "stream": True, "ignore_eos": True}
        client = httpx.Client(timeout=60)
        with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers) as r:
            request_id = r.headers["x-request-id"]
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
            killed_at = time.monotonic()
            doomed.kill(signal.SIGKILL)
        # The worker stops generating for it: one completion, cancelled, well short of 2000 tokens.
        done = wait_for_events(topics.USAGE.name, lambda e: e.record["request_id"] == request_id, timeout=30)
        assert len(done) == 1
        assert done[0].record["status"] == "cancelled", done[0].record
        assert done[0].record["completion_tokens"] < 6 * 2000
        assert time.monotonic() - killed_at < 30
    finally:
        doomed.stop()
