"""What every benchmark shares: one percentile definition, the machine it ran on, its JSON file."""
from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]}


def write_json(path: str | Path, result: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"written to {out}")


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) of xs, linearly interpolated between the two nearest ranks (numpy's
    default); None for no samples. Every benchmark's p50/p95/p99 means this."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def sample_percentile(xs: Sequence[float], q: float) -> float:
    """percentile() where the run always has samples (a measured loop, not a filtered subset): an empty
    list is the benchmark's own bug."""
    p = percentile(xs, q)
    if p is None:
        raise ValueError("no samples to take a percentile of")
    return p


def table(rows: list[dict], columns: list[tuple[str, int, object, str]]) -> list[str]:
    """A fixed-width text table: a header, a rule, one line per row. Each column is (title, width,
    the row's key or a function of the row, format spec for numbers); None prints as "-", and a
    negative width left-aligns."""
    def cell(row, get, spec):
        value = get(row) if callable(get) else row[get]
        if value is None:
            return "-"
        return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)

    def aligned(text, width):
        return f"{text:<{-width}}" if width < 0 else f"{text:>{width}}"

    head = " ".join(aligned(title, width) for title, width, _, _ in columns)
    return [head, "-" * len(head)] + [" ".join(aligned(cell(row, get, spec), width) for _, width, get, spec in columns)
                                      for row in rows]
