"""Restart the Kafka broker under load, again and again, with the machine busy: every time the stack
serves again within RECOVERY_BOUND_S of the broker's return, every stream in flight finishes whole,
and every request is billed exactly once. Also while streams is starting, and while a standby's
join has the streams group rebalancing."""
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx
import pytest

from schemas import topics
from tests.integration.conftest import ADMIN_TOKEN
from tests.integration.kafka_probe import read_to_end
from tests.integration.processes import Service, free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.faults]

MODEL = "tiny"
# A new request must be served within this long after the broker is back (issue 12's target).
# Measured with a CPU burner alongside on the 2-core dev machine: see docs/streams.md.
RECOVERY_BOUND_S = 10.0
# The outer limit while measuring, so that a slow recovery is reported with its time, not as a hang.
PROBE_LIMIT_S = 60.0
RESTARTS = 10
STREAMS = 6
STREAM_TOKENS = 600


@pytest.fixture(scope="module")
def busy_machine():
    """One process of our own keeps a core busy, as a package install did when the hang was seen."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield burner
    burner.kill()
    burner.wait()


class Load:
    """STREAMS long streaming completions, each recording the tokens it has received so far."""

    def __init__(self, stack, tag: str):
        self.stack = stack
        self.results: dict[int, dict] = {}
        self.received = [0] * STREAMS
        self.threads = [threading.Thread(target=self._stream, args=(i, f"{tag} {i}")) for i in range(STREAMS)]

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 60
        while min(self.received) == 0 and time.monotonic() < deadline and any(t.is_alive() for t in self.threads):
            time.sleep(0.01)
        return self

    def _stream(self, index: int, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": STREAM_TOKENS, "stream": True,
                "ignore_eos": True, "seed": index}
        finish, error, request_id = None, None, None
        try:
            with httpx.stream("POST", f"{self.stack.base_url}/completions", json=body, timeout=180,
                              headers={"Authorization": f"Bearer {self.stack.api_key}"}) as r:
                request_id = r.headers.get("x-request-id")
                if r.status_code != 200:
                    error = (r.status_code, r.read().decode())
                else:
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = ("sse", chunk["error"])
                            continue
                        for choice in chunk["choices"]:
                            self.received[index] += 1
                            finish = choice["finish_reason"] or finish
        except httpx.HTTPError as exc:
            error = ("transport", repr(exc))
        self.results[index] = {"request_id": request_id, "tokens": self.received[index], "finish": finish,
                               "error": error}

    def finish(self) -> list[dict]:
        for t in self.threads:
            t.join(240)
        assert len(self.results) == STREAMS
        for r in self.results.values():
            assert r["error"] is None and r["finish"] == "length" and r["tokens"] == STREAM_TOKENS, r
        return list(self.results.values())


def _probe(stack, back: float) -> tuple[float, float, str]:
    """One short request; (sent, done) in seconds after the broker was back, and its outcome."""
    sent = time.monotonic() - back
    try:
        r = httpx.post(f"{stack.base_url}/completions", headers={"Authorization": f"Bearer {stack.api_key}"},
                       json={"model": MODEL, "prompt": "after", "max_tokens": 3, "timeout": 10}, timeout=60)
        outcome = "ok" if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
    except httpx.HTTPError as exc:
        outcome = repr(exc)
    return sent, time.monotonic() - back, outcome


def _time_to_serve(stack, back: float, limit: float = PROBE_LIMIT_S) -> tuple[float | None, list]:
    """Seconds from `back` until a new request was first served (None if not within `limit`).

    A probe starts every 0.25 s and they run concurrently, so one that hangs (ingress holds a request
    up to its deadline plus a grace period) does not delay the next one."""
    probes = []
    with ThreadPoolExecutor(max_workers=16) as pool:
        pending = set()
        while time.monotonic() - back < limit:
            if len(pending) < 16:
                pending.add(pool.submit(_probe, stack, back))
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            probes += [f.result() for f in done]
            if any(outcome == "ok" for _, _, outcome in probes):
                break
        for f in pending:
            f.cancel()
        probes += [f.result() for f in pending if not f.cancelled()]
    served = [d for _, d, outcome in probes if outcome == "ok"]
    return (min(served) if served else None), sorted(probes)


def _leaderless() -> list[str]:
    """Partitions the broker itself names no leader for."""
    from confluent_kafka.admin import AdminClient

    from infra import kafka_clients

    meta = AdminClient({"bootstrap.servers": kafka_clients.bootstrap_servers()}).list_topics(timeout=10)
    return sorted(f"{t}[{p}]" for t, tm in meta.topics.items() for p, pm in tm.partitions.items() if pm.leader < 0)


def _broker_warnings(local_kafka) -> str:
    lines = [line for line in local_kafka.log_file.read_text(errors="replace").splitlines()
             if " WARN " in line or " ERROR " in line]
    return "\n".join(lines[-40:])


def _stacks_and_logs(stack) -> str:
    """Every service's threads (faulthandler on SIGUSR1, see tokenmill/cli.py) and log tail: what a
    failed recovery leaves to read."""
    import psutil

    for service in stack.services.values():
        if service.proc is None or service.proc.poll() is not None:
            continue
        for proc in [psutil.Process(service.proc.pid), *psutil.Process(service.proc.pid).children(recursive=True)]:
            try:
                proc.send_signal(signal.SIGUSR1)
            except psutil.Error:
                pass
    time.sleep(1.0)  # the dumps are written by the services themselves
    tails = []
    for name, service in stack.services.items():
        lines = [line for line in service.log().splitlines() if not line.startswith("%")]
        tails.append(f"===== {name} =====\n" + "\n".join(lines[-80:]))
    return "\n".join(tails)


def _restart_broker(local_kafka) -> float:
    local_kafka.stop()
    local_kafka.start()
    return time.monotonic()


def _assert_billed_once(stack, finished: list[dict]) -> None:
    """Each request is completed on `usage` with every token, and billed once: one ledger row each.

    `usage` may carry a completion twice (a record resent on a fresh client after a stall, see
    infra/resilient_producer.py); the ledger is keyed by request id, and that is what is billed."""
    ids = {r["request_id"] for r in finished}
    assert len(ids) == len(finished) and None not in ids
    rows = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = httpx.post(f"{stack.billing_url}/admin/ledger/lookup", json={"request_ids": sorted(ids)},
                          headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        if len(rows) >= len(ids):
            break
        time.sleep(0.5)
    assert sorted(row["request_id"] for row in rows) == sorted(ids)  # one row each: none twice
    assert all(row["completion_tokens"] == STREAM_TOKENS for row in rows)
    # What the ledger was built from: every request completed on `usage`, each time with every token.
    events = read_to_end(topics.USAGE.name, lambda e: e.record["request_id"] in ids)
    assert {e.record["request_id"] for e in events} == ids
    assert {e.record["completion_tokens"] for e in events} == {STREAM_TOKENS}


def _need_own_broker(local_kafka) -> None:
    if local_kafka is None:
        pytest.fail("these fault tests need the session's own broker (unset KAFKA_BOOTSTRAP_SERVERS)")


def test_ten_broker_restarts_under_load(stack, local_kafka, busy_machine):
    _need_own_broker(local_kafka)
    recoveries, in_flight_at_stop, finished = [], [], []
    for round_ in range(RESTARTS):
        load = Load(stack, f"round {round_}").start()
        in_flight_at_stop.append(sum(1 for n in load.received if n < STREAM_TOKENS))
        back = _restart_broker(local_kafka)
        served_after, probes = _time_to_serve(stack, back)
        print(f"restart {round_ + 1}: served {served_after} s after the broker was back, "
              f"{in_flight_at_stop[-1]} of {STREAMS} streams in flight at the stop")
        assert served_after is not None, (f"{probes[:3]}\nleaderless: {_leaderless()}\n"
                                          f"broker:\n{_broker_warnings(local_kafka)}\n{_stacks_and_logs(stack)}")
        recoveries.append(served_after)
        finished += load.finish()
    print(f"recovery over {RESTARTS} restarts: p50 {statistics.median(recoveries):.2f} s, "
          f"max {max(recoveries):.2f} s: {[round(r, 2) for r in recoveries]}")
    # Streams really were cut by the restarts: most rounds stopped the broker mid-stream.
    assert sum(1 for n in in_flight_at_stop if n > 0) >= RESTARTS // 2, in_flight_at_stop
    assert max(recoveries) <= RECOVERY_BOUND_S, recoveries
    _assert_billed_once(stack, finished)
    _assert_new_keys_are_learned(stack)


def _assert_new_keys_are_learned(stack, bound_s: float = 20.0) -> None:
    """Every follower of a topic still follows it: a key issued after the restarts is accepted (seen
    without the stall remedy of infra/partition_reader.py: ingress never learned one again)."""
    key = stack.issue_tenant(f"after-restarts-{time.monotonic_ns()}")
    issued = time.monotonic()
    while True:
        status = httpx.get(f"{stack.base_url}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code
        if status == 200:
            break
        assert time.monotonic() - issued < bound_s, f"a key issued after the restarts still gets {status}"
        time.sleep(0.2)  # polling the public API: there is no event to wait on from outside
    print(f"a key issued after the restarts was accepted {time.monotonic() - issued:.2f} s later")


def test_broker_restart_while_streams_is_starting(stack, local_kafka, busy_machine):
    _need_own_broker(local_kafka)
    streams = stack.services["streams"]
    streams.kill()  # SIGKILL: the new process must also take the state over from a crash
    streams.start()
    time.sleep(0.5)  # well inside its start-up (imports alone take longer)
    back = _restart_broker(local_kafka)
    streams.wait_log("scheduler active", timeout=120)
    served_after, probes = _time_to_serve(stack, back)
    print(f"broker restart during streams start-up: served {served_after} s after the broker was back")
    assert served_after is not None and served_after <= 60, probes
    load = Load(stack, "after start-up restart").start()
    _assert_billed_once(stack, load.finish())


def _active(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tokenmill:streams_active "):
                return int(float(line.split()[1]))
    raise AssertionError("no tokenmill:streams_active metric")


def test_broker_restart_while_a_standby_joins(stack, local_kafka, busy_machine):
    """A second streams instance joins (the group rebalances) and the broker restarts in the middle of
    it: one of the two ends up active, the other standby, and no stream in flight is lost."""
    _need_own_broker(local_kafka)
    first = stack.services["streams"]
    first_port = int(stack.env["TOKENMILL_STREAMS_METRICS_PORT"])
    standby_port = free_port()
    standby = Service("streams-standby", ["serve", "streams"],
                      {**stack.env, "TOKENMILL_STREAMS_METRICS_PORT": str(standby_port)},
                      first.log_path.parent)
    try:
        load = Load(stack, "standby join").start()
        standby.start()
        standby.wait_log("joining the streams group", timeout=120)
        back = _restart_broker(local_kafka)
        served_after, probes = _time_to_serve(stack, back)
        print(f"broker restart during a standby's join: served {served_after} s after the broker was back")
        assert served_after is not None and served_after <= RECOVERY_BOUND_S, probes
        finished = load.finish()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                actives = _active(first_port) + _active(standby_port)
            except OSError:
                actives = None
            if actives == 1:
                break
            time.sleep(0.5)
        assert actives == 1, f"{actives} active streams instances"
        _assert_billed_once(stack, finished)
    finally:
        standby.stop()
