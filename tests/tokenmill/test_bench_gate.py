"""The gate benchmark's verdicts: what counts as lost, duplicated, reordered, and held."""
from __future__ import annotations

from tokenmill.benchmarks.platform.gate import StepResult, judge


def _seen(order: list[tuple[int, int]], partition: int = 0, delay_ms: float = 5.0) -> dict[str, list[tuple]]:
    """(tenant, n) in release order on one partition -> sightings as the pool records them."""
    return {f"r-{tenant}-{n}": [(partition, offset, delay_ms, 1_000_000 + offset)]
            for offset, (tenant, n) in enumerate(order)}


def _judged(seen, sent: int, rejected: int = 0) -> dict:
    step = StepResult(tenants=2, offered_rps=100.0, sent=sent, rejected=rejected)
    judge(step, seen, started=1_000.0)
    return step.row(slo_p99_ms=1000)


def test_every_request_once_in_order_is_held():
    row = _judged(_seen([(0, 0), (1, 1), (0, 2), (1, 3)]), sent=4)
    assert row["held"] and row["lost"] == 0 and row["out_of_order"] == 0 and row["duplicates"] == 0


def test_a_tenants_requests_released_out_of_arrival_order_are_counted():
    # tenant 0's request 2 leaves before its request 0; tenant 1 keeps its order
    row = _judged(_seen([(0, 2), (1, 1), (0, 0), (1, 3)]), sent=4)
    assert row["out_of_order"] == 1 and not row["held"]


def test_the_same_order_across_partitions_is_not_a_reordering():
    seen = _seen([(0, 2)], partition=0)
    seen.update(_seen([(0, 0)], partition=1))
    assert _judged(seen, sent=2)["out_of_order"] == 0


def test_a_missing_or_repeated_release_fails_the_step():
    seen = _seen([(0, 0), (0, 1)])
    assert _judged(seen, sent=3)["lost"] == 1
    seen["r-0-1"].append((0, 9, 5.0, 1_000_009))
    row = _judged(seen, sent=2)
    assert row["duplicates"] == 1 and not row["held"]


def test_a_slow_release_fails_the_step_on_its_delay():
    assert not _judged(_seen([(0, 0), (0, 1)], delay_ms=5_000.0), sent=2)["held"]
