"""Settings every tokenmill process shares, read from the environment."""
from __future__ import annotations

import hmac
import json
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infra import settings
from infra.env_setting import Setting

# The real model `make up` serves (fetched and converted once by gpu_consumers/wheel_model.py) and the
# random one the benches and fast tests build (gpu_consumers/default_model.py).
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
RANDOM_MODEL_NAME = "tokenmill-small"


def default_model_dir() -> Path:
    return settings.LOCAL_DIR.get() / "models" / DEFAULT_MODEL_NAME


def random_model_dir() -> Path:
    return settings.LOCAL_DIR.get() / "models" / "small"


def local_secret(setting: Setting[str], file_name: str, make) -> str:
    """The setting if set, else a secret made once in .local/<file_name>, mode 0600.

    Made whole in a private temporary file and then linked into place, so a process starting at
    the same moment sees either no file or the whole secret, never an empty one; the first link
    wins and everyone reads that one."""
    if setting.is_set():
        return setting.get()
    path = settings.LOCAL_DIR.get() / file_name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{file_name}.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(make())
            os.link(tmp, path)
        except FileExistsError:  # another process made it first
            pass
        finally:
            os.unlink(tmp)
    value = path.read_text().strip()
    if not value:
        raise RuntimeError(f"{path} is empty; remove it to have a new secret made, or set {setting.name}")
    return value


def key_secret() -> bytes:
    """The HMAC secret for API key hashes; the same for every ingress."""
    return local_secret(settings.KEY_SECRET, "key_secret", lambda: secrets.token_hex(32)).encode()


def metrics_host() -> str:
    """Where worker and streams serve Prometheus metrics. Loopback unless told otherwise: the
    metrics carry tenant ids, and a scraper on another host is a deliberate choice."""
    return settings.METRICS_HOST.get()


def default_max_tokens() -> int:
    """The completion length of a request (HTTP or batch line) that names no max_tokens."""
    return settings.DEFAULT_MAX_TOKENS.get()


def heartbeat_interval_s() -> float:
    """How often ingress tells workers it still reads its reply partition."""
    return settings.HEARTBEAT_INTERVAL_S.get()


def admin_listener(public_port: int) -> tuple[str, int]:
    """Where ingress serves its admin API, /metrics and /docs: loopback and the public port + 1 unless
    told otherwise (TOKENMILL_ADMIN_HOST, TOKENMILL_ADMIN_PORT). Never the public listener: one
    leaked admin token is then not enough from outside the host."""
    return settings.ADMIN_HOST.get(), settings.ADMIN_PORT.get() or public_port + 1


def same_secret(presented: str | None, expected: str) -> bool:
    """Constant-time comparison of a presented token with the configured one, as bytes: a header
    with non-ASCII characters is simply a wrong token (str comparison would raise)."""
    if not presented:
        return False
    return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape"))


def admin_token() -> str:
    """Bearer token of the admin APIs (ingress and billing)."""
    return local_secret(settings.ADMIN_TOKEN, "admin_token", lambda: secrets.token_urlsafe(32))


def local_worker_threads() -> int:
    """Torch threads for a CPU worker sharing its machine with the rest of the stack: one core
    fewer than the machine has. A parallel op waits for its slowest thread, so when ingress,
    streams, billing or the broker take a core from one of the worker's threads, every step
    stalls; on 2 cores a 2-thread worker decoded at half the speed of a 1-thread one
    (docs/serving.md)."""
    return max(1, (os.cpu_count() or 2) - 1)


def billing_url() -> str:
    """Where the billing process answers analytics (it alone opens the embedded ClickHouse)."""
    return settings.BILLING_URL.get()


def internal_token() -> str:
    """What ingress presents to billing when it asks on a tenant's behalf."""
    return local_secret(settings.INTERNAL_TOKEN, "internal_token", lambda: secrets.token_urlsafe(32))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path

    @property
    def max_model_len(self) -> int:
        cfg = json.loads((self.path / "config.json").read_text())
        return int(cfg.get("max_position_embeddings", 2048))


class NotACheckpoint(ValueError):
    """A served model's directory is not a checkpoint tokenmill can serve; the message says why."""


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a Hugging Face checkpoint directory tokenmill can serve (its config, its
    safetensors weights and a tokenizer), or None when it is one."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    wanted = {"config.json": ["config.json"],
              "safetensors weights": ["model.safetensors", "model.safetensors.index.json"],
              "a tokenizer": ["tokenizer.json", "tokenizer.model"]}
    missing = [what for what, names in wanted.items() if not any((path / n).is_file() for n in names)]
    return f"it lacks {', '.join(missing)}" if missing else None


def served_models(check: bool = True) -> dict[str, ModelSpec]:
    """`TOKENMILL_MODELS="name=/path,other=/path"`; default: the real model `make up` converts.

    Each directory is checked to be a checkpoint (`check`), so a wrong path stops the service that
    reads it at start-up with one clear line instead of failing later in a tokenizer or a worker."""
    raw = settings.MODELS.get() or f"{DEFAULT_MODEL_NAME}={default_model_dir()}"
    models = {}
    for item in raw.split(","):
        name, _, path = item.strip().partition("=")
        if not item.strip():
            continue
        if not name or not path:
            raise NotACheckpoint(f"TOKENMILL_MODELS: {item.strip()!r} is not name=checkpoint_dir")
        models[name] = ModelSpec(name, Path(path))
        problem = checkpoint_problem(Path(path)) if check else None
        if problem:
            raise NotACheckpoint(f"TOKENMILL_MODELS: {name}={path} is not a checkpoint directory: {problem}")
    return models


def token_weights_from_env():
    """`TOKENMILL_TOKEN_WEIGHTS="input=1,output=1,cached_input=0.5"`: how usage counts against quota.
    Ingress and streams both read it, so the edge and the authority count the same quota tokens."""
    from schedulers import TokenWeights

    values = {}
    for part in settings.TOKEN_WEIGHTS.get().split(","):
        name, _, value = part.partition("=")
        if name.strip() in ("input", "output", "cached_input") and value:
            values[name.strip()] = float(value)
    return TokenWeights(**values)


# --- LoRA adapters (docs/lora.md) ---------------------------------------------------------------
def max_lora_rank() -> int:
    """The largest LoRA rank an adapter may have: the registry refuses more, the engine sizes its slots by it."""
    return settings.MAX_LORA_RANK.get()


def max_adapter_bytes() -> int:
    """The largest adapter_model.safetensors the registry accepts (default 64 MiB: rank 64 on every
    projection of the 135M model in float16 is ~40 MB)."""
    return settings.MAX_ADAPTER_BYTES.get()


def max_adapters_per_tenant() -> int:
    """How many adapters one tenant may have registered at once (the registry answers 429 past it)."""
    return settings.MAX_ADAPTERS_PER_TENANT.get()


def max_adapter_bytes_per_tenant() -> int:
    """The sum of one tenant's registered adapter files (default 256 MiB: four of the largest), 429 past it:
    every worker follows every adapter's bytes."""
    return settings.MAX_ADAPTER_BYTES_PER_TENANT.get()


def quantization() -> str | None:
    """The worker's weight quantization (``TOKENMILL_QUANTIZATION``): unset for the checkpoint's own
    precision, or "int8" (CPU only; docs/benchmarks.md, "int8 projections")."""
    return settings.QUANTIZATION.get()


def kv_cache_dtype() -> str | None:
    """The worker's KV cache element type (``TOKENMILL_KV_CACHE_DTYPE``): unset for the weights' own
    dtype, or float32 / float16 / bfloat16."""
    value = settings.KV_CACHE_DTYPE.get()
    if value not in (None, "float32", "float16", "bfloat16"):
        raise ValueError(f"TOKENMILL_KV_CACHE_DTYPE must be float32, float16 or bfloat16, not {value!r}")
    return value


def max_loras() -> int:
    """Adapters a worker's engine holds at once (its LRU slots)."""
    return settings.MAX_LORAS.get()


def adapter_cache_dir(worker_id: str) -> Path:
    """Where a worker writes the adapters it serves (from the `adapters` topic), one directory per version."""
    return settings.ADAPTER_CACHE_DIR.get() / worker_id
