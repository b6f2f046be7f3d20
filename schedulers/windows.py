"""Time windows used by quotas, as pure functions of a timestamp.

Rate windows are *fixed* and aligned to the epoch (``floor(now / window_s) * window_s``)
so that every process (ingress, streams) agrees on which window a moment belongs to
without talking; that is what makes the remote-usage merge in quota.py well defined.
Monthly budgets use calendar months in UTC.
"""
from __future__ import annotations

import math
from datetime import datetime, timezone


def window_start(now: float, window_s: float) -> float:
    return math.floor(now / window_s) * window_s


def month_key(now: float) -> str:
    """``"YYYY-MM"`` of the UTC calendar month containing ``now``; sorts chronologically."""
    # The quota ledger asks for every request, several times: remember the last month's bounds.
    start, end, key = _last_month
    if start <= now < end:
        return key
    moment = datetime.fromtimestamp(now, tz=timezone.utc)
    key = f"{moment.year:04d}-{moment.month:02d}"
    _last_month[:] = [datetime(moment.year, moment.month, 1, tzinfo=timezone.utc).timestamp(),
                      next_month_start(now), key]
    return key


_last_month: list = [0.0, 0.0, ""]


def next_month_start(now: float) -> float:
    moment = datetime.fromtimestamp(now, tz=timezone.utc)
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    return datetime(year, month, 1, tzinfo=timezone.utc).timestamp()
