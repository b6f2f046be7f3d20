"""A C source of csrc/, built on first use with the machine's C compiler and loaded with ctypes.

Built with `$CC` (else `cc`), -O3 -march=native -fopenmp and the source's own flags, about a second, into a
per-user cache directory named by a hash of the source, the flags, the compiler and the CPU, so each
machine builds it once. Where no compiler works, `load()` answers None (the reason logged once, kept in
`failed`) and the caller keeps its torch path."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


class NativeLibrary:
    def __init__(self, source: str, signatures: dict[str, list], extra_flags: tuple[str, ...] = ()) -> None:
        """source: a file of csrc/; signatures: each exported function's ctypes argument types (it returns
        nothing)."""
        self.source = CSRC / source
        self.signatures = signatures
        self.flags = [*FLAGS, *extra_flags]
        self.failed: str | None = None
        self._functions: dict[str, ctypes._CFuncPtr] | None = None
        self._lock = threading.Lock()

    def load(self) -> dict[str, ctypes._CFuncPtr] | None:
        if self._functions is None and self.failed is None:
            with self._lock:
                if self._functions is None and self.failed is None:
                    self._build()
        return self._functions

    def _build(self) -> None:
        cc = os.environ.get("CC", "cc")
        try:
            version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
            key = hashlib.sha256("\0".join([self.source.read_text(), *self.flags, version, _cpu_flags()]).encode())
            cache = Path(tempfile.gettempdir()) / f"tokenmill-kernels-{os.getuid()}"
            lib = cache / f"{self.source.stem}-{key.hexdigest()[:16]}.so"
            if not lib.exists():
                cache.mkdir(parents=True, exist_ok=True)
                partial = cache / f".{lib.name}.{os.getpid()}.{threading.get_ident()}"
                subprocess.run([cc, *self.flags, str(self.source), "-o", str(partial), "-lm"], capture_output=True,
                               text=True, check=True)
                os.replace(partial, lib)  # atomic: a concurrent builder never loads a half-written file
            handle = ctypes.CDLL(str(lib))
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = (getattr(exc, "stderr", None) or str(exc)).strip()
            self.failed = f"{type(exc).__name__}: {detail.splitlines()[0][:200] if detail else ''}"
            log.warning("native %s unavailable: %s", self.source.stem, self.failed)
            return
        functions = {}
        for name, argtypes in self.signatures.items():
            fn = getattr(handle, name)
            fn.argtypes, fn.restype = argtypes, None
            functions[name] = fn
        self._functions = functions
