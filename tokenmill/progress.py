"""Progress bars for what a person waits on (batch collect, the benchmarks' phases), via tqdm.

Drawn on stderr when it is a terminal; when it is not (a log, CI, a pipe) they print nothing at
all, so captured output holds results only. Output printed ``with above_bars():`` goes above a
live bar instead of through it.
"""
from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: int | None = None, desc: str | None = None, unit: str = "it", stream=None,
        enabled: bool = True) -> tqdm:
    stream = sys.stderr if stream is None else stream
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not (enabled and _is_terminal(stream)),
                dynamic_ncols=True, leave=False)


def above_bars():
    """A context in which printing to stdout does not tear a bar drawn on the same terminal."""
    return tqdm.external_write_mode(file=sys.stdout)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a file
        return False
