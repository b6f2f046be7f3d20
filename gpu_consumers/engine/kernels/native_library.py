"""A C source of csrc/, built on first use with the machine's C compiler and loaded with ctypes.

Built with `$CC` (else `cc`), -O3 -march=native -fopenmp and the source's own flags, about a second, into a
per-user cache directory (`$XDG_CACHE_HOME/tokenmill-kernels`, else `~/.cache/tokenmill-kernels`) under a
name made of a hash of the source, the flags, the compiler and the CPU, so each machine builds it once.
Where no compiler works, `load()` answers None (the reason logged once, kept in `failed`) and the caller
keeps its torch path.

What is loaded runs inside a worker that holds the Kafka credentials and sees every prompt, and the file
name is predictable, so nobody else may be able to put a file there (issue 56): the directory must be the
current user's, mode 0700 when made, not a link, writable by nobody else; the library is opened without
following links, checked the same way on its descriptor (its owner, a regular file, no group or other write)
and handed to the loader as that descriptor, so what was checked is what runs. A cache directory that fails
the check is not used: the library is built into a fresh private directory of this process instead."""
from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]


class KernelArgumentError(ValueError):
    """A C kernel called with arguments that would make it read or write outside its tensors."""


class ArgumentChecks:
    """The C kernels check no bounds themselves; their Python wrappers do, when this is on (the engine's
    tests turn it on; it costs a device sync and a few reductions per call, so serving leaves it off)."""
    enabled = False

    @classmethod
    def require(cls, ok: bool, message: str) -> None:
        if not ok:
            raise KernelArgumentError(message)


class UnsafeCache(OSError):
    """A cache directory or file that someone other than the current user could have written."""


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tokenmill-kernels"


def _check_owned(fd: int, what: str, kind) -> None:
    st = os.fstat(fd)
    if not kind(st.st_mode):
        raise UnsafeCache(f"{what} is not a {'directory' if kind is stat.S_ISDIR else 'regular file'}")
    if st.st_uid != os.getuid():
        raise UnsafeCache(f"{what} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCache(f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def open_private_dir(path: Path) -> int:
    """A descriptor of directory `path` (made 0700 when missing); UnsafeCache when it is a link, someone
    else's, or writable by group or others."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:  # ELOOP: a link; ENOTDIR: a file
        raise UnsafeCache(f"{path} cannot be opened as a directory without following links ({exc})") from None
    try:
        _check_owned(fd, str(path), stat.S_ISDIR)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_file(dir_fd: int, name: str, what: str) -> int:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeCache(f"{what} is a symbolic link") from None
        raise
    try:
        _check_owned(fd, what, stat.S_ISREG)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


class NativeLibrary:
    def __init__(self, source: str, signatures: dict[str, list], extra_flags: tuple[str, ...] = (),
                 cache_dir: Path | None = None) -> None:
        """source: a file of csrc/; signatures: each exported function's ctypes argument types (it returns
        nothing); cache_dir: where built libraries are kept (default_cache_dir() when None)."""
        self.source = CSRC / source
        self.signatures = signatures
        self.flags = [*FLAGS, *extra_flags]
        self.cache_dir = cache_dir
        self.failed: str | None = None
        self.loaded_from: str | None = None
        self._functions: dict[str, Any] | None = None  # ctypes functions
        self._lock = threading.Lock()
        # Held open for the life of the process: the loader knows the library by "/proc/self/fd/N", and a
        # later library opened under a reused N would be taken for this one.
        self._fd: int | None = None

    def load(self) -> dict[str, Any] | None:
        if self._functions is None and self.failed is None:
            with self._lock:
                if self._functions is None and self.failed is None:
                    self._build()
        return self._functions

    def file_name(self, cc: str = "cc") -> str:
        """The cached library's name: a hash of everything that makes it differ."""
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256("\0".join([self.source.read_text(), *self.flags, version, _cpu_flags()]).encode())
        return f"{self.source.stem}-{key.hexdigest()[:16]}.so"

    def _compile(self, cc: str, dir_fd: int, directory: Path, name: str) -> None:
        partial = f".{name}.{os.getpid()}.{threading.get_ident()}"
        subprocess.run([cc, *self.flags, str(self.source), "-o", str(directory / partial), "-lm"],
                       capture_output=True, text=True, check=True)
        os.chmod(partial, 0o700, dir_fd=dir_fd)  # whatever the umask: writable by nobody else
        # atomic: a concurrent builder never loads a half-written file
        os.replace(partial, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def _open_built(self, cc: str, directory: Path, name: str) -> int:
        """A checked descriptor of the library in `directory`, built there first when missing."""
        dir_fd = open_private_dir(directory)
        try:
            try:
                return open_private_file(dir_fd, name, str(directory / name))
            except FileNotFoundError:
                self._compile(cc, dir_fd, directory, name)
                return open_private_file(dir_fd, name, str(directory / name))
        finally:
            os.close(dir_fd)

    def _open(self, cc: str) -> int:
        name = self.file_name(cc)
        cache = self.cache_dir if self.cache_dir is not None else default_cache_dir()
        try:
            return self._open_built(cc, cache, name)
        except UnsafeCache as exc:
            log.warning("native %s: not using the kernel cache (%s); building a private copy", self.source.stem, exc)
        private = Path(tempfile.mkdtemp(prefix="tokenmill-kernels-"))  # 0700, a name nobody can guess
        try:
            return self._open_built(cc, private, name)
        finally:
            shutil.rmtree(private, ignore_errors=True)  # the open descriptor keeps the file

    def _build(self) -> None:
        cc = os.environ.get("CC", "cc")
        try:
            fd = self._open(cc)
            try:
                handle = ctypes.CDLL(f"/proc/self/fd/{fd}")
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
            self.loaded_from = os.readlink(f"/proc/self/fd/{fd}")
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
