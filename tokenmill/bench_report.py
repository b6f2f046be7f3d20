"""What every benchmark writes besides its table: the machine it ran on and a JSON file."""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]}


def write_json(path: str | Path, result: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"written to {out}")
