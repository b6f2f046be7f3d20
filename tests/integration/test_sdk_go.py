"""The official `openai-go` SDK (github.com/openai/openai-go/v3, version locked in tests/sdk/go/go.sum),
unmodified, against the real stack: tests/sdk/go/main.go, built by tests/sdk/install.sh, runs every check once
(models, chat whole/streamed/n/logprobs, a JSON schema answer decoded into a struct, a tool call round trip, the
Responses API, files and batches, and the error types: 401, 429 with Retry-After retried by the SDK, 404 model),
one test here per check."""
from __future__ import annotations

import pytest

from tests.integration.sdk_programs import CHECKS, ROOT, assert_check, install, program_env, run_checks

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def go_outcome(stack):
    install("go")
    return run_checks([str(ROOT / ".local" / "go" / "bin" / "sdkcheck")], program_env(stack, "go"))


@pytest.mark.parametrize("check", CHECKS)
def test_go_sdk(go_outcome, check):
    assert_check(go_outcome, check)


def test_go_program_ran_every_check_and_nothing_else(go_outcome):
    assert sorted(go_outcome.results) == sorted(CHECKS), go_outcome.output[-4000:]
    assert go_outcome.returncode == (0 if all(ok for ok, _ in go_outcome.results.values()) else 1)
