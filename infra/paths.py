"""Where tokenmill keeps its local, git-ignored state (both settings: infra/settings.py)."""
from __future__ import annotations

from pathlib import Path

from infra import settings

REPO_ROOT = settings.REPO_ROOT


def local_dir() -> Path:
    return settings.LOCAL_DIR.get()


def kafka_libs() -> Path:
    return settings.KAFKA_LIBS.get()
