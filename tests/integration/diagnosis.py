"""What a failed integration test leaves to read, in a few lines: for each service of its stack, how far
its log got, the warnings and errors it logged, and where its main thread is now.

A flake on a loaded CI machine is read from the run's output alone (the services' logs stay on that
machine), and only the head and tail of that output are shown, so this is short and is printed again
at the end of the run (conftest.py's pytest_terminal_summary)."""
from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

DUMP_MARK = "most recent call first"
DIGEST_SECTION = "stack digest"  # the report section a failed test's digest goes in
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d (\d\d:\d\d:\d\d),\d+ ")
_NUMBERS = re.compile(r"\b[0-9a-f]{32}\b|\b\d+(\.\d+)?\b")
_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')


def live_services(log_dir: Path) -> dict[int, Path]:
    """Processes of this test run writing their output to a log in log_dir (the stack's services and
    any a test started beside them): pid -> log."""
    import psutil

    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            # only the services (and a supervised streams' child): a helper process of theirs (a grammar
            # compiler) shares the log but has no SIGUSR1 handler, and the signal would kill it
            if "tokenmill.cli" not in proc.cmdline():
                continue
            for f in proc.open_files():
                if Path(f.path).parent == log_dir and f.path.endswith(".log"):
                    found[proc.pid] = Path(f.path)
        except psutil.Error:
            continue
    return found


def dump_threads(services: dict[int, Path], timeout: float = 5.0) -> None:
    """SIGUSR1 to each (tokenmill/cli.py has faulthandler print every thread to the log), then wait a
    little for the dumps: a process too stuck to write one is itself the finding."""
    sizes = {pid: log.stat().st_size for pid, log in services.items()}
    for pid in services:
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            sizes.pop(pid, None)
    deadline = time.monotonic() + timeout
    while sizes and time.monotonic() < deadline:
        for pid, size in list(sizes.items()):
            with open(services[pid], "rb") as f:
                f.seek(size)
                if DUMP_MARK.encode() in f.read():
                    del sizes[pid]
        time.sleep(0.1)


def main_thread(text: str, frames: int = 3) -> str:
    """The innermost frames of the main thread in the last thread dump of a log ('' without a dump).
    faulthandler lists threads newest first, so the main thread is the last one listed: its frames follow
    the log's last "(most recent call first):" line."""
    at = text.rfind(DUMP_MARK)
    if at < 0:
        return ""
    found = []
    for line in text[at:].splitlines()[1:]:
        m = _FRAME.match(line)
        if m is None:
            break
        found.append(m.groups())
    return " < ".join(f"{Path(f).parent.name}/{Path(f).name}:{n} {fn}" for f, n, fn in found[:frames])


def log_digest(path: Path, warnings: int = 3) -> list[str]:
    text = path.read_text(errors="replace")
    lines = [line for line in text.splitlines() if not line.startswith("%")]
    stamps = [m.group(1) for line in lines if (m := _STAMP.match(line))]
    kinds = Counter()
    last: dict[str, str] = {}
    for line in lines:
        if " WARNING " in line or " ERROR " in line or " CRITICAL " in line:
            kind = _NUMBERS.sub("#", _STAMP.sub("", line))[:120]
            kinds[kind] += 1
            last[kind] = line
    head = f"{path.stem}: {len(lines)} lines, last at {stamps[-1] if stamps else '-'}"
    where = main_thread(text)
    out = [head + (f"; main thread: {where}" if where else "")]
    for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:warnings]:
        out.append(f"  {n}x {last[kind][:220]}")
    return out


def digest(log_dir: Path) -> str:
    """The short account of a stack's logs (after asking every live service for its threads)."""
    log_dir = Path(log_dir)
    out = [f"logs in {log_dir}:"]
    try:
        dump_threads(live_services(log_dir))
    except Exception as exc:  # a diagnostic must not hide the failure it is there to explain
        out.append(f"(no thread dumps: {exc})")
    for path in sorted(log_dir.glob("*.log")):
        out += log_digest(path)
    return "\n".join(out)
