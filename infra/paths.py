"""Where tokenmill keeps its local, git-ignored state."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LOCAL_DIR = Path(os.environ.get("TOKENMILL_LOCAL_DIR", REPO_ROOT / ".local"))
KAFKA_LIBS = Path(os.environ.get("TOKENMILL_KAFKA_LIBS", LOCAL_DIR / "kafka" / "libs"))
