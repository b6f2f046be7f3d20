"""A setting read from the environment, and the registry every one is declared in (infra/settings.py).

This module is the only one outside the engine that reads the process environment (the engine, which imports
no tokenmill package, reads where its C kernels' compiler and cache are itself). A value is read when it is
asked for, not at import: the CLI sets `KAFKA_BOOTSTRAP_SERVERS` for the services it starts, and tests set
variables per test.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Mapping, TypeVar

T = TypeVar("T")


class SettingError(ValueError):
    """A variable holds a value its type cannot take; the message names it."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: Callable[[], T]
    shown_default: str  # the default as the README says it
    doc: str
    group: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default()
        try:
            return self.parse(raw)
        except (TypeError, ValueError) as exc:
            raise SettingError(f"{self.name}={raw!r}: {exc}") from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


REGISTRY: dict[str, Setting] = {}
GROUPS: list[str] = []


def declare(setting: Setting[T]) -> Setting[T]:
    assert setting.name not in REGISTRY, setting.name
    REGISTRY[setting.name] = setting
    if setting.group not in GROUPS:
        GROUPS.append(setting.group)
    return setting


def const(value: T) -> Callable[[], T]:
    return lambda: value


def flag(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return raw == "1"


def positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def text_setting(name: str, default: str | None, shown: str, doc: str, group: str) -> Setting:
    return declare(Setting(name, str, const(default), shown, doc, group))


def int_setting(name: str, default: int, shown: str, doc: str, group: str, parse: Callable[[str], int] = int) -> Setting[int]:
    return declare(Setting(name, parse, const(default), shown, doc, group))


def float_setting(name: str, default: float, shown: str, doc: str, group: str) -> Setting[float]:
    return declare(Setting(name, float, const(default), shown, doc, group))


def flag_setting(name: str, default: bool, shown: str, doc: str, group: str) -> Setting[bool]:
    return declare(Setting(name, flag, const(default), shown, doc, group))


def path_setting(name: str, default: Callable[[], Path], shown: str, doc: str, group: str) -> Setting[Path]:
    return declare(Setting(name, Path, default, shown, doc, group))


def check_all() -> None:
    """Parse every declared variable that is set (SettingError naming the first bad one)."""
    for setting in REGISTRY.values():
        if setting.is_set():
            setting.get()


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with `extra` over it: what a process tokenmill starts inherits."""
    return {**os.environ, **(extra or {})}


def export(name: str, value: str) -> None:
    """Set a variable for this process and every process it starts from now on (the CLI does, for the
    broker it started)."""
    os.environ[name] = value


def graphical_session() -> bool:
    """Whether a browser can be opened here (a display, or macOS)."""
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) or sys.platform == "darwin"


def markdown_table() -> str:
    """The README's configuration table: one section per group, one row per variable."""
    out = []
    for group in GROUPS:
        out += [f"**{group}**", "", "| variable | default | meaning |", "|---|---|---|"]
        out += [f"| `{s.name}` | {s.shown_default} | {s.doc} |" for s in REGISTRY.values() if s.group == group]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
