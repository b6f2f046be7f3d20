"""The per-hop TTFT breakdown joins a client's two times with the stamps of its request's events."""
from __future__ import annotations

from tokenmill.benchmarks.platform.hop_latency import HOPS, join, summary


def test_each_hop_is_the_gap_between_consecutive_stamps_and_they_add_up_to_ttft():
    stamps = {"r1": {"requests": 1010, "work": 1015, "started": 1100, "first_token": 1400, "replies": 1401}}
    hops = join([("r1", 1000.0, 1420.0)], stamps)
    assert [hops[h] for h in HOPS] == [[10], [5], [85], [300], [1], [19], [420]]
    assert sum(hops[h][0] for h in HOPS[:-1]) == hops["total TTFT"][0]


def test_a_request_with_any_event_missing_is_left_out_rather_than_counted_as_zero():
    complete = {"requests": 1, "work": 2, "started": 3, "first_token": 4, "replies": 5}
    stamps = {"ok": complete, "no-usage": {k: v for k, v in complete.items() if k not in ("started", "first_token")}}
    hops = join([("ok", 0.0, 6.0), ("no-usage", 0.0, 6.0), ("unknown", 0.0, 6.0)], stamps)
    assert all(len(v) == 1 for v in hops.values())
    table = summary(hops)
    assert table["total TTFT"]["n"] == 1 and table["total TTFT"]["p50"] == 6.0
