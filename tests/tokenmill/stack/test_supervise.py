"""tokenmill.stack.processes.supervise: restart on the agreed exit codes (or on any failure), and stop for good on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tokenmill.stack.processes import supervise

# A child that counts its starts in a file and exits with the status listed for that start.
CHILD = textwrap.dedent("""
    import sys, time
    path, codes = sys.argv[1], sys.argv[2].split(",")
    n = len(open(path).read()) if __import__("os").path.exists(path) else 0
    open(path, "a").write("x")
    code = codes[min(n, len(codes) - 1)]
    if code == "hang":
        time.sleep(60)
    sys.exit(int(code))
""")


def _starts(path) -> int:
    return len(path.read_text()) if path.exists() else 0


def test_restarts_on_the_agreed_code_until_another_exit(tmp_path):
    counter = tmp_path / "starts"
    code = supervise([sys.executable, "-c", CHILD, str(counter), "3,3,0"], {3}, backoff_s=0)
    assert code == 0 and _starts(counter) == 3


def test_other_exit_codes_end_the_loop(tmp_path):
    counter = tmp_path / "starts"
    assert supervise([sys.executable, "-c", CHILD, str(counter), "1,0"], {3}, backoff_s=0) == 1
    assert _starts(counter) == 1


def test_without_codes_any_failure_restarts_and_a_clean_exit_ends(tmp_path):
    counter = tmp_path / "n"
    assert supervise([sys.executable, "-c", CHILD, str(counter), "1,3,0"], None, backoff_s=0) == 0
    assert _starts(counter) == 3


def test_restart_limit(tmp_path):
    counter = tmp_path / "starts"
    assert supervise([sys.executable, "-c", CHILD, str(counter), "3"], {3}, backoff_s=0, max_restarts=2) == 3
    assert _starts(counter) == 3


def test_sigterm_stops_the_child_and_the_loop(tmp_path):
    counter = tmp_path / "starts"
    script = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); from tokenmill.stack.processes import supervise; "
              f"sys.exit(supervise([sys.executable, '-c', {CHILD!r}, {str(counter)!r}, 'hang'], {{3}}, backoff_s=0))")
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 20
    while _starts(counter) < 1:
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 128 + signal.SIGTERM  # the child's fate, passed on as a shell would
    assert _starts(counter) == 1  # not started again


def test_sigterm_between_a_crash_and_the_restart_starts_no_new_child(tmp_path):
    """Seen when a fenced streams process exited to rejoin and the stop came during the backoff: the
    new child was never told and ran until SIGKILL."""
    counter = tmp_path / "starts"
    script = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); from tokenmill.stack.processes import supervise; "
              f"sys.exit(supervise([sys.executable, '-c', {CHILD!r}, {str(counter)!r}, '3,hang'], {{3}}, backoff_s=2))")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        assert "starting it again" in proc.stderr.readline()  # the child exited with 3: the backoff has begun
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 128 + signal.SIGTERM
        assert _starts(counter) == 1
    finally:
        proc.kill()
