"""Jain's index, the maximum service difference, and the sliding service window."""
from __future__ import annotations

import pytest

from schedulers.fairness_index import ServiceWindow, jain_index, max_service_difference


def test_jain_index_is_one_for_equal_service_and_one_over_n_for_a_monopoly():
    assert jain_index([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None


def test_max_service_difference_only_between_backlogged_tenants():
    service = {"a": 100.0, "b": 10.0, "c": 1.0}
    assert max_service_difference(service, {"a", "b"}) == 90.0
    assert max_service_difference(service, {"a", "z"}) == 100.0  # backlogged but unserved
    assert max_service_difference(service, {"a"}) is None


def test_service_window_forgets_what_is_older_than_the_window():
    w = ServiceWindow(window_s=10.0)
    w.add("a", 5.0, now=0.0)
    w.add("b", 2.0, now=6.0)
    w.add("a", 1.0, now=8.0)
    assert w.totals(9.0) == {"a": 6.0, "b": 2.0}
    assert w.totals(12.0) == {"a": 1.0, "b": 2.0}
    assert w.totals(30.0) == {}


def test_service_window_survives_empty_and_tiny_services_expiring_in_any_order():
    """A request settled at zero tokens (refunded) or rounding crumbs must not break the window
    (it once raised KeyError inside streams' metrics timer and took the scheduler down)."""
    w = ServiceWindow(window_s=10.0)
    w.add("a", 5.0, now=0.0)
    w.add("a", 0.0, now=1.0)
    w.add("a", 0.1 + 0.2 - 0.3, now=2.0)  # 5.5e-17
    w.add("b", -1.0, now=3.0)
    assert w.totals(5.0) == {"a": 5.0 + (0.1 + 0.2 - 0.3)}
    assert w.totals(100.0) == {}
    w.add("a", 1.0, now=101.0)
    assert w.totals(102.0) == {"a": 1.0}
