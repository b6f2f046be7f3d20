"""llama.cpp's `llama-server` as the peer of `tokenmill bench serve`: the server a CPU user would otherwise
pick, on the same checkpoint as a GGUF (llamacpp.py builds both), driven over HTTP
with the same workload, the same client and the same metrics.

llama-server batches continuously over a fixed number of slots (`--parallel`), each with its own share of
the context (`--ctx-size` is split over the slots), so it is given one slot per request the run may have
in flight and a context that fits each request's prompt and output. Its threads are matched to the
tokenmill worker's (`local_worker_threads()`, what `make up` gives the worker) unless told otherwise.
"""
from __future__ import annotations

import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tokenmill.benchmarks.engine import llamacpp
from tokenmill.benchmarks.engine.llamacpp import LlamaCppUnavailable, bin_dir, root

# Tokens per random word of bench serve's prompts, with room: SmolLM2's tokenizer makes ~3.0 of them
# (3.15 at most over 50 prompts of 128 words).
CONTEXT_MARGIN = 4.0
READY_TIMEOUT_S = 120.0


def server_command(gguf: Path, port: int, slots: int, tokens_per_slot: int, threads: int,
                   repack: bool = True) -> list[str]:
    """The llama-server command line: `slots` parallel sequences of up to `tokens_per_slot` each; without
    weight repacking where it crashes (llamacpp.repack_crashes)."""
    return [str(bin_dir() / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "--ctx-size", str(slots * tokens_per_slot), "--threads", str(threads),
            "--threads-batch", str(threads), "--cont-batching", "--no-webui", "--log-disable",
            *([] if repack else ["--no-repack"])]


def tokens_per_slot(input_len: int, output_len: int, range_ratio: float, prefix_len: int) -> int:
    """Context one request may need: its longest prompt (words, with margin for tokens) and output."""
    longest_prompt = (input_len * (1 + range_ratio) + prefix_len) * CONTEXT_MARGIN
    longest_output = output_len * (1 + range_ratio)
    return int(longest_prompt + longest_output) + 16


@contextmanager
def running(gguf: Path, port: int, slots: int, per_slot: int, threads: int) -> Iterator[str]:
    """A llama-server for the duration of the block; yields its OpenAI base URL."""
    import httpx

    log_path = root() / "server.log"
    log = open(log_path, "ab")
    try:
        repack = not llamacpp.repack_crashes(gguf)
        if not repack:
            print("llama-server runs with --no-repack: ggml's AMX kernels die of SIGILL on this machine", flush=True)
        proc = subprocess.Popen(server_command(gguf, port, slots, per_slot, threads, repack), stdout=log,
                                stderr=subprocess.STDOUT)
    except OSError as exc:
        log.close()
        raise LlamaCppUnavailable(f"llama-server did not start: {exc}") from exc
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise LlamaCppUnavailable(f"llama-server exited {proc.returncode} before it was ready (log: {log_path})")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise LlamaCppUnavailable(f"llama-server not ready in {READY_TIMEOUT_S:.0f} s (log: {log_path})")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# What the comparison shows: (key in summarize()'s result, percentile or None, higher is better)
COMPARED = (("output_throughput", None, True), ("request_throughput", None, True),
            ("ttft_ms", "p50", False), ("ttft_ms", "p99", False), ("tpot_ms", "p50", False),
            ("itl_ms", "p99", False), ("e2el_ms", "p50", False))


def compare(platform: dict, peer: dict) -> list[dict]:
    """tokenmill / llama-server per metric (None where either side has no value)."""
    rows = []
    for key, q, higher_better in COMPARED:
        a = platform[key][q] if q else platform[key]
        b = peer[key][q] if q else peer[key]
        rows.append({"metric": f"{key} {q}" if q else key, "tokenmill": a, "llama_server": b,
                     "ratio": a / b if a is not None and b else None, "higher_is_better": higher_better})
    return rows


def format_comparison(rows: list[dict]) -> str:
    def f(v, fmt=".2f"):
        return "-" if v is None else format(v, fmt)

    lines = [f"{'metric':<22}{'tokenmill':>12}{'llama-server':>14}{'tokenmill/peer':>16}  better",
             "-" * 72]
    for r in rows:
        lines.append(f"{r['metric']:<22}{f(r['tokenmill']):>12}{f(r['llama_server']):>14}{f(r['ratio'], '.3f'):>16}"
                     f"  {'higher' if r['higher_is_better'] else 'lower'}")
    return "\n".join(lines)
