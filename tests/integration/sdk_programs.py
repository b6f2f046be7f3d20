"""The official OpenAI SDKs of other languages against the session's stack: each language has one small program
under tests/sdk/<language>/ that runs every check and prints `CHECK <name> ok` or `CHECK <name> FAIL <why>`
(tests/integration/test_sdk_node.py, test_sdk_go.py assert on those lines, one test per check).

Their dependencies are installed at the locked versions by tests/sdk/install.sh (`make test` runs it first; the
tests run it again, which does nothing when nothing changed). A missing toolchain fails the tests: they are not
skipped.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.integration.conftest import MODEL_NAME

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "tests" / "sdk" / "install.sh"
# The checks every language's program runs, by name (the names each prints).
CHECKS = (
    "models.list", "models.retrieve", "chat.whole", "chat.stream", "chat.n", "chat.logprobs",
    "chat.structured_output", "chat.tool_round_trip", "responses.create_retrieve_delete", "responses.stream",
    "files_and_batches", "error.401_authentication", "error.404_model", "error.429_retried",
)
LINE = re.compile(r"^CHECK (\S+) (ok|FAIL)(?: (.*))?$")
# What one tenant may do: the program's checks run one after another, and the batch and the n=2 requests are
# more than a default plan's concurrency would let one of them queue.
ROOMY = dict(requests_per_minute=10**6, tokens_per_minute=10**9, max_concurrent=64, max_queued=10**5,
             monthly_token_budget=10**12)


@dataclass
class Outcome:
    results: dict[str, tuple[bool, str]]
    output: str
    returncode: int


def install(part: str, timeout: float = 1200) -> None:
    done = subprocess.run([str(INSTALL), part], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"tests/sdk/install.sh {part} failed:\n{done.stdout}\n{done.stderr}"


def program_env(stack, language: str) -> dict[str, str]:
    """The program's environment: its own roomy tenant, and one allowed a single request at a time (429s)."""
    key = stack.issue_tenant(f"sdk-{language}", **ROOMY)
    single = stack.issue_tenant(f"sdk-{language}-single", **{**ROOMY, "max_concurrent": 1})
    return {"TOKENMILL_BASE_URL": stack.base_url, "TOKENMILL_API_KEY": key, "TOKENMILL_SINGLE_KEY": single,
            "TOKENMILL_MODEL": MODEL_NAME}


def run_checks(command: list[str], env: dict[str, str], timeout: float = 600) -> Outcome:
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)
    results = {}
    for line in done.stdout.splitlines():
        match = LINE.match(line.strip())
        if match:
            results[match[1]] = (match[2] == "ok", match[3] or "")
    return Outcome(results, done.stdout + done.stderr, done.returncode)


def assert_check(outcome: Outcome, name: str) -> None:
    assert name in outcome.results, f"the program never reported {name}:\n{outcome.output[-4000:]}"
    ok, why = outcome.results[name]
    assert ok, why
