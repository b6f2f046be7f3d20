"""A whole tokenmill stack (streams, one worker, ingress, billing) against the session's real broker,
and one against a module's own 3-broker cluster for the broker-loss tests."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tokenmill.stack.spec import StackSpec, WorkerSpec
from tests.support.waiting import wait_key_accepted
from tokenmill.stack.processes import Service, free_port, start_stack, stop_all

TEST_SECRET = "integration-test-secret"
ADMIN_TOKEN = "integration-admin-token"
MODEL_NAME = "tiny"
# A second pool of the same model, served only while a test runs its own small worker for it
# (tests/integration/test_fairness_preemption.py): a test can saturate it without touching `tiny`.
SMALL_POOL_MODEL = "tiny-small-pool"
# The real model `make up` serves. The session stack's ingress knows it; a worker serves it only while
# tests/integration/test_real_model.py runs its own (so the rest of the suite pays nothing for it).
REAL_MODEL = "smollm2-135m-instruct"
REPLY_PARTITION = 0  # the `replies` partition the stack's ingress reads


@dataclass
class Stack:
    base_url: str
    api_key: str
    tenant_id: str
    services: dict[str, Service]
    env: dict[str, str]
    billing_url: str | None = None
    admin_url: str | None = None  # ingress's admin listener (admin API, /metrics, /docs)

    def issue_tenant(self, tenant_id: str, wait: bool = True, **limits) -> str:
        """A tenant with its limits and a key; with `wait`, returned once this stack's ingress accepts it."""
        from ingress.tenancy.tenant_admin import TenantAdmin

        admin = TenantAdmin(TEST_SECRET.encode())
        admin.upsert(tenant_id, name=tenant_id, **limits)
        key = admin.issue_key(tenant_id).key
        if wait:
            wait_key_accepted(self.base_url, key)
        return key


@contextmanager
def running_stack(bootstrap: str, tiny_model_dir: Path, prefix: str = "tokenmill-stack-",
                  real_model_dir: Path | None = None, warm_grammars: bool = True) -> Iterator[Stack]:
    """Streams, one worker, ingress (reply partition REPLY_PARTITION) and billing as subprocesses against
    the Kafka at `bootstrap`, with a tenant `acme` whose key ingress already accepts; stopped on exit.
    Without `warm_grammars` its workers start their grammar compile process at the first structured-output
    request instead of at start (TOKENMILL_GRAMMAR_WARM=0), for stacks whose tests send none.

    Clients the test itself makes (the tenant admin, probes) read KAFKA_BOOTSTRAP_SERVERS: the caller
    points it at the same cluster."""
    os.environ["TOKENMILL_KEY_SECRET"] = TEST_SECRET
    log_dir = Path(tempfile.mkdtemp(prefix=prefix))
    admin_port = free_port()
    worker = WorkerSpec("worker", "test-worker-0", MODEL_NAME, tiny_model_dir, free_port(), threads=1, kv_cache_mb=64)
    spec = StackSpec(
        env={"KAFKA_BOOTSTRAP_SERVERS": bootstrap,
             "TOKENMILL_KEY_SECRET": TEST_SECRET,
             "TOKENMILL_MODELS": f"{MODEL_NAME}={tiny_model_dir},{SMALL_POOL_MODEL}={tiny_model_dir}"
                                 + (f",{REAL_MODEL}={real_model_dir}" if real_model_dir else ""),
             "TOKENMILL_CLICKHOUSE_URL": f"chdb://{log_dir / 'clickhouse'}",
             "TOKENMILL_ADMIN_TOKEN": ADMIN_TOKEN,
             "TOKENMILL_INTERNAL_TOKEN": "integration-internal-token",
             "TOKENMILL_BATCH_DIR": str(log_dir / "batches"),
             "TOKENMILL_STREAMS_METRICS_PORT": str(free_port()),
             # where the billing dashboard's live panel reads ingress
             "TOKENMILL_INGRESS_METRICS_URL": f"http://127.0.0.1:{admin_port}/metrics",
             "OMP_NUM_THREADS": "1",
             # one compile process, warmed at start (the default): each imports torch, and a dozen
             # stacks start in a run on two cores
             "TOKENMILL_GRAMMAR_COMPILE_PROCESSES": "1",
             "TOKENMILL_GRAMMAR_WARM": "1" if warm_grammars else "0"},
        ingress_port=free_port(), billing_port=free_port(), workers=[worker], admin_port=admin_port,
        reply_partition=REPLY_PARTITION)
    services = start_stack(spec, log_dir)
    try:
        from ingress.tenancy.tenant_admin import TenantAdmin

        admin = TenantAdmin(TEST_SECRET.encode())
        admin.upsert("acme", name="Acme")
        key = admin.issue_key("acme").key
        s = Stack(base_url=spec.base_url, api_key=key, tenant_id="acme", services=services, env=spec.service_env(),
                  billing_url=spec.billing_url, admin_url=f"http://127.0.0.1:{admin_port}")
        wait_key_accepted(s.base_url, key)
        yield s
    finally:
        stop_all(services.values())


@pytest.fixture(scope="session")
def session_stack(kafka_bootstrap, tiny_model_dir, real_model_dir):
    with running_stack(kafka_bootstrap, tiny_model_dir, real_model_dir=real_model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def stack(request):
    """The stack a module's tests run on: the session's, or for a module marked `faults` (it kills,
    restarts or starves services) one of its own on its own broker, so that no other module runs on
    a stack that has just been through its faults and a fault test's flake stays in its module."""
    if request.node.get_closest_marker("faults"):
        return request.getfixturevalue("own_stack")
    return request.getfixturevalue("session_stack")


@pytest.fixture(scope="module")
def own_stack(own_kafka, tiny_model_dir):
    """A whole stack of the module's own on the module's own broker (tests/conftest.py own_kafka): for
    the modules that kill, restart or starve its services (marked `faults`: `stack` below is then this)."""
    # No fault module sends a structured-output request; each of their ~20 worker starts would spend
    # ~2 s of CPU on a compile process it never uses.
    with running_stack(own_kafka.bootstrap, tiny_model_dir, prefix="tokenmill-own-stack-", warm_grammars=False) as s:
        yield s


@pytest.fixture(scope="module")
def cluster_stack(kafka_cluster, tiny_model_dir):
    """A whole stack of the module's own against the module's 3-broker cluster (tests/conftest.py)."""
    with running_stack(kafka_cluster.bootstrap, tiny_model_dir, prefix="tokenmill-cluster-stack-",
                       warm_grammars=False) as s:
        yield s


@pytest.fixture(scope="module")
def sdk_client(stack):
    """The official openai client as the stack's tenant, retrying as the SDK does by default."""
    import openai

    return openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on a stack gets a digest of that stack's logs (tests/integration/diagnosis.py)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or report.when == "teardown":
        return
    from tests.integration import diagnosis

    dirs = {service.log_path.parent for value in getattr(item, "funcargs", {}).values()
            if isinstance(value, Stack) for service in value.services.values()}
    for log_dir in sorted(dirs):
        try:
            text = diagnosis.digest(log_dir)
        except Exception as exc:  # a diagnostic must not hide the failure it is there to explain
            text = f"(no digest of {log_dir}: {exc!r})"
        report.sections.append((diagnosis.DIGEST_SECTION, text))
