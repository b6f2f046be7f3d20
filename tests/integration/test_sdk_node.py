"""The official `openai` Node SDK (npm, version locked in tests/sdk/node/package-lock.json), unmodified, against
the real stack: tests/sdk/node/check.mjs runs every check once (models, chat whole/streamed/n/logprobs, a zod
schema parsed into a typed object, a tool call round trip, the Responses API, files and batches, and the error
types: 401 AuthenticationError, 429 with Retry-After retried by the SDK, 404 model), one test here per check."""
from __future__ import annotations

import pytest

from tests.integration.sdk_programs import CHECKS, assert_check, install, program_env, run_checks

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def node_outcome(stack):
    install("node")
    return run_checks(["node", "tests/sdk/node/check.mjs"], program_env(stack, "node"))


@pytest.mark.parametrize("check", CHECKS)
def test_node_sdk(node_outcome, check):
    assert_check(node_outcome, check)


def test_node_program_ran_every_check_and_nothing_else(node_outcome):
    assert sorted(node_outcome.results) == sorted(CHECKS), node_outcome.output[-4000:]
    assert node_outcome.returncode == (0 if all(ok for ok, _ in node_outcome.results.values()) else 1)
