"""Settings every tokenmill process shares, read from the environment."""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from infra.paths import LOCAL_DIR

DEFAULT_MODEL_NAME = "tokenmill-small"


def key_secret() -> bytes:
    """The HMAC secret for API key hashes: $TOKENMILL_KEY_SECRET, else one made once under .local/."""
    env = os.environ.get("TOKENMILL_KEY_SECRET")
    if env:
        return env.encode()
    path = LOCAL_DIR / "key_secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip().encode()


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path

    @property
    def max_model_len(self) -> int:
        cfg = json.loads((self.path / "config.json").read_text())
        return int(cfg.get("max_position_embeddings", 2048))


def served_models() -> dict[str, ModelSpec]:
    """`TOKENMILL_MODELS="name=/path,other=/path"`; default: the locally built small model."""
    raw = os.environ.get("TOKENMILL_MODELS") or f"{DEFAULT_MODEL_NAME}={LOCAL_DIR / 'models' / 'small'}"
    models = {}
    for item in raw.split(","):
        name, _, path = item.strip().partition("=")
        if name and path:
            models[name] = ModelSpec(name, Path(path))
    return models


def admin_token() -> str:
    """Bearer token of the admin API: $TOKENMILL_ADMIN_TOKEN, else one made once under .local/."""
    env = os.environ.get("TOKENMILL_ADMIN_TOKEN")
    if env:
        return env
    path = LOCAL_DIR / "admin_token"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(32))
        path.chmod(0o600)
    return path.read_text().strip()
