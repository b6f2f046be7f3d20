"""One grammar-compile process (structured_outputs/compile_pool.py starts it: ``python -m structured_outputs.compile_child``).

xgrammar 0.2.9 has no way to stop a compile once it runs in C++, so compiles run here, where the
pool can kill this process when one runs past its time limit. Frames on stdin/stdout are a 4-byte
big-endian length and UTF-8 JSON. The first frame in is ``{"tokenizer_info": <TokenizerInfo JSON>}``,
answered ``{"ready": true}``; then each ``{"spec": ...}`` is answered ``{"compiled": <CompiledGrammar
JSON>}`` or ``{"error": message, "param": field}``. The process ends when stdin closes.

Before anything else it caps its own memory and offers itself first to the kernel's OOM killer
(`apply_limits`): a schema whose compile allocates without end then fails this process alone (a
MemoryError answered as that spec's error, or the process killed), never the server beside it.
"""
from __future__ import annotations

import json
import os
import struct
import sys

from infra import settings


def read_frame(stream) -> dict | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def write_frame(stream, message: dict) -> None:
    body = json.dumps(message).encode()
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()



def apply_limits() -> None:
    import resource

    # The data segment and private mappings a compile process may hold (RLIMIT_DATA): xgrammar's import with
    # torch holds ~0.8 GB of it here, a compile of an admitted schema a few MB more.
    limit_mb = settings.GRAMMAR_MEMORY_MB.get()
    resource.setrlimit(resource.RLIMIT_DATA, (limit_mb * 2**20, limit_mb * 2**20))
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # the first to go when the machine runs out of memory
    except OSError:  # not Linux, or not allowed: the memory limit still holds
        pass


def main() -> int:
    apply_limits()
    # The frames own stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = os.fdopen(os.dup(0), "rb")
    from structured_outputs.errors import GrammarError
    from structured_outputs.xgrammar_backend import XgrammarBackend

    first = read_frame(inp)
    if first is None:
        return 0
    backend = XgrammarBackend(first["tokenizer_info"])
    write_frame(out, {"ready": True})
    while True:
        message = read_frame(inp)
        if message is None:
            return 0
        try:
            write_frame(out, {"compiled": backend.serialize(backend.compile(message["spec"]))})
        except GrammarError as exc:
            write_frame(out, {"error": str(exc), "param": exc.param})
        except Exception as exc:  # noqa: BLE001 - any failure is this spec's
            write_frame(out, {"error": f"The schema could not be compiled: {type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    sys.exit(main())
