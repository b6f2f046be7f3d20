"""The control-plane benchmark's verdicts: what counts as a held rate and a lossless ledger."""
from __future__ import annotations

import pytest

from tokenmill.benchmarks.harness.client import Answer
from tokenmill.benchmarks.platform.control_plane import compare_ledger, step_result


def _answers(n: int, tokens: int = 2) -> list[Answer]:
    return [Answer(status=200, request_id=f"r{i}", completion_tokens=tokens, latency_s=0.01 * (i + 1))
            for i in range(n)]


def _rows(answers: list[Answer]) -> list[dict]:
    return [{"request_id": a.request_id, "status": "finished", "completion_tokens": a.completion_tokens}
            for a in answers]


def test_exact_ledger_is_lossless_and_held():
    answers = _answers(10)
    ledger = compare_ledger(answers, _rows(answers))
    step = step_result(10, 1, answers, 1.0, ledger, slo_p99_ms=1000)
    assert step["lossless"] and step["held"]
    assert step["ok"] == 10 and step["achieved_rate"] == 10


@pytest.mark.parametrize("damage, field", [
    (lambda rows: rows[1:], "missing_from_ledger"),
    (lambda rows: rows + [{"request_id": "ghost", "status": "finished", "completion_tokens": 2}],
     "billed_but_not_answered"),
    (lambda rows: rows + [dict(rows[0])], "repeated_rows"),
    (lambda rows: [dict(rows[0], completion_tokens=3)] + rows[1:], "token_mismatches"),
    (lambda rows: rows + [{"request_id": "x", "status": "failed", "completion_tokens": 0}], "non_finished_rows"),
])
def test_any_ledger_discrepancy_fails_the_step(damage, field):
    answers = _answers(5)
    ledger = compare_ledger(answers, damage(_rows(answers)))
    assert ledger[field] >= 1
    step = step_result(5, 1, answers, 1.0, ledger, slo_p99_ms=1000)
    assert not step["lossless"] and not step["held"]


def test_errors_or_slow_p99_fail_the_step():
    answers = _answers(5)
    refused = answers + [Answer(status=429, error="rate_limit_exceeded", latency_s=0.001)]
    step = step_result(6, 1, refused, 1.0, compare_ledger(refused, _rows(answers)), slo_p99_ms=1000)
    assert step["errors"] == {"rate_limit_exceeded": 1} and not step["held"]
    slow = step_result(5, 1, answers, 1.0, compare_ledger(answers, _rows(answers)), slo_p99_ms=20)
    assert slow["latency_ms"]["p99"] > 20 and not slow["held"]
