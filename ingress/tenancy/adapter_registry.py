"""Registering a tenant's LoRA adapter: every check before anything is stored, then its records on
`adapters` (lora/adapters.py). The admin API (ingress/admin/adapters.py) and `tokenmill adapters` share it.

The files are checked by the validation module the engine loads them with (formats/adapter_files.py:
PEFT config, rank, target modules, tensor names, shapes against the base checkpoint's config.json,
dtypes, size), so what registers is exactly what a worker's engine accepts; then the file is opened with
the safetensors library itself, as the worker opens it, and every weight is read and held to the bounds
the engine checks again when it loads (finite, |A| and |B x scaling| at most MAX_LORA_WEIGHT: docs/lora.md,
"Isolation"), so a refusal is a 400 naming the tensor here rather than a failed request later. That module is
standard library only (formats/ is below every package in the layers), so ingress pays nothing for torch.
"""
from __future__ import annotations

import base64
import binascii
import json
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from formats import adapter_files
from lora import adapters
from infra.config import (ModelSpec, max_adapter_bytes, max_adapter_bytes_per_tenant, max_adapters_per_tenant,
                          max_lora_rank)
from schemas.records import AdapterManifest

RECENT_S = 60.0


class AdapterRejected(ValueError):
    """A registration refused: the message says why, `param` names the field at fault."""

    def __init__(self, message: str, param: str, code: str = "invalid_adapter"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Registration:
    tenant_id: str
    name: str
    base_model: str
    adapter_config: dict[str, Any]
    weights: bytes


UPLOAD_FIELDS = ("name", "base_model", "adapter_config", "weights")


def prepare_registration(raw: bytes, tenant_id: str, models: dict[str, ModelSpec], max_rank: int,
                         max_bytes: int) -> tuple[str, Any]:
    """An upload body read in full, for the admin API's checking process (ingress/admin/adapter_uploads.py):
    ("ok", (Registration, check_files' answer)) or ("refused", (status, message, code, param)). Answers
    rather than raises: exceptions of custom signatures do not cross processes."""
    from ingress.http.json_body import decode_object
    from http_api.openai_errors import APIError

    try:
        data = decode_object(raw)
    except APIError as exc:
        return "refused", (exc.status, exc.message, exc.code, exc.param)
    unknown = sorted(set(data) - set(UPLOAD_FIELDS))
    if unknown:
        return "refused", (400, f"Unrecognized request argument supplied: {unknown[0]}", "unknown_parameter",
                           unknown[0])
    for name in UPLOAD_FIELDS:
        if name not in data:
            return "refused", (400, f"Missing required parameter: '{name}'.", "missing_required_parameter", name)
    try:
        reg = Registration(tenant_id, data["name"], data["base_model"], data["adapter_config"],
                           decode_weights(data["weights"]))
        checked = AdapterRegistry(models, max_rank=max_rank, max_bytes=max_bytes).check_files(reg)
    except AdapterRejected as exc:
        return "refused", (400, str(exc), exc.code, exc.param)
    return "ok", (reg, checked)


def decode_weights(text: object) -> bytes:
    if not isinstance(text, str) or not text:
        raise AdapterRejected("'weights' must be the base64 text of adapter_model.safetensors.", "weights")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise AdapterRejected("'weights' is not valid base64.", "weights") from None


def _config_param(message: str) -> str:
    for field in ("target_modules", "lora_alpha", "use_rslora", "peft_type"):
        if field in message:
            return f"adapter_config.{field}"
    if ": r must" in message or ": r=" in message:
        return "adapter_config.r"
    return "adapter_config"


def check_weight_values(file: str, weights: bytes, spec) -> None:
    """Opens `file` (whose bytes are `weights`) with the safetensors library and holds every lora_A and
    scaled lora_B weight to the engine's bound; LoraLoadError naming the first tensor that fails."""
    import numpy as np
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="numpy") as opened:  # the library's own checks of the header
            names = set(opened.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise adapter_files.LoraLoadError(f"{file}: the safetensors library cannot open it ({exc})") from None
    header = adapter_files.read_safetensors_header(file)
    start = 8 + int.from_bytes(weights[:8], "little")
    for a_name, b_name in spec.tensors.values():
        for name, scaling in ((a_name, 1.0), (b_name, spec.scaling)):
            if name not in names:
                raise adapter_files.LoraLoadError(f"{file}: tensor {name!r} is not in the file the library reads")
            entry = header[name]
            begin, end = entry["data_offsets"]
            raw = np.frombuffer(weights, dtype=np.uint8, count=end - begin, offset=start + begin)
            values = _as_float32(raw, entry["dtype"], np)
            scaled = " scaled by " + format(scaling, "g") if scaling != 1.0 else ""
            if not np.isfinite(values).all():
                raise adapter_files.LoraLoadError(f"{file}: tensor {name!r} holds NaN or infinite values")
            peak = float(np.abs(values).max()) * abs(scaling) if values.size else 0.0
            if not peak <= adapter_files.MAX_LORA_WEIGHT:
                raise adapter_files.LoraLoadError(
                    f"{file}: tensor {name!r}{scaled} reaches {peak:.3g}, over the bound of "
                    f"{adapter_files.MAX_LORA_WEIGHT:g} on an adapter weight")


def _as_float32(raw, dtype: str, np):
    if dtype == "BF16":  # numpy has no bfloat16: its bits are a float32's upper half
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return raw.view("<f4" if dtype == "F32" else "<f2")


class AdapterRegistry:
    """Checks registrations against the served models and the limits, and stores them."""

    def __init__(self, models: dict[str, ModelSpec], publisher: adapters.AdapterPublisher | None = None,
                 max_rank: int | None = None, max_bytes: int | None = None, max_per_tenant: int | None = None,
                 max_bytes_per_tenant: int | None = None):
        self.models = models
        self.max_rank = max_rank if max_rank is not None else max_lora_rank()
        self.max_bytes = max_bytes if max_bytes is not None else max_adapter_bytes()
        self.max_per_tenant = max_per_tenant if max_per_tenant is not None else max_adapters_per_tenant()
        self.max_bytes_per_tenant = (max_bytes_per_tenant if max_bytes_per_tenant is not None
                                     else max_adapter_bytes_per_tenant())
        self._publisher = publisher
        # One registration of a tenant at a time in this process, from its checks to its acknowledgement:
        # two of one name would both pass the clash check, and two of a tenant at its quota would both fit.
        self._tenant_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        # Registrations acknowledged here in the last RECENT_S, maybe not yet in the caller's view of the topic.
        self._recent: dict[str, tuple[AdapterManifest, float]] = {}

    @property
    def publisher(self) -> adapters.AdapterPublisher:
        if self._publisher is None:
            self._publisher = adapters.AdapterPublisher()
        return self._publisher

    def check(self, reg: Registration, existing: adapters.AdapterCatalog) -> tuple[int, tuple[str, ...]]:
        """(rank, target modules) of a registration that may be stored; AdapterRejected otherwise."""
        checked = self.check_files(reg)
        self.check_catalog(reg, existing)
        return checked

    def _check_name_and_base(self, reg: Registration) -> ModelSpec:
        if not isinstance(reg.name, str) or not adapters.NAME_PATTERN.fullmatch(reg.name):
            raise AdapterRejected(f"Invalid 'name': {reg.name!r} is not {adapters.NAME_RULE}.", "name",
                                  "invalid_value")
        spec = self.models.get(reg.base_model) if isinstance(reg.base_model, str) else None
        if spec is None:
            raise AdapterRejected(f"The base model {reg.base_model!r} is not served here (served: "
                                  f"{sorted(self.models)}).", "base_model", "model_not_found")
        return spec

    def check_catalog(self, reg: Registration, existing: adapters.AdapterCatalog) -> None:
        """What the registered adapters decide: the name is free, the tenant's quotas have room."""
        self._check_name_and_base(reg)
        if existing.get(adapters.adapter_id(reg.tenant_id, reg.name)) is not None:
            raise AdapterRejected(f"Tenant '{reg.tenant_id}' already has an adapter named '{reg.name}'; delete it "
                                  f"first.", "name", "adapter_exists")
        count, held = existing.usage_of(reg.tenant_id)
        if count >= self.max_per_tenant:
            raise AdapterRejected(f"Tenant '{reg.tenant_id}' has {count} adapters, the most it may have "
                                  f"(TOKENMILL_MAX_ADAPTERS_PER_TENANT={self.max_per_tenant}); delete one first.",
                                  "name", "adapter_quota_exceeded")
        if held + len(reg.weights) > self.max_bytes_per_tenant:
            raise AdapterRejected(f"Tenant '{reg.tenant_id}' holds {held} bytes of adapters; {len(reg.weights)} more "
                                  f"is over its {self.max_bytes_per_tenant} (TOKENMILL_MAX_ADAPTER_BYTES_PER_TENANT); "
                                  f"delete one first.", "weights", "adapter_quota_exceeded")

    def check_files(self, reg: Registration) -> tuple[int, tuple[str, ...]]:
        """(rank, target modules) of files a worker's engine would serve, read in full; AdapterRejected
        otherwise. Needs no catalog: an upload runs it in a process of its own (adapter_uploads.py)."""
        spec = self._check_name_and_base(reg)
        if not isinstance(reg.adapter_config, dict):
            raise AdapterRejected("'adapter_config' must be the JSON object of a PEFT adapter_config.json.",
                                  "adapter_config")
        if len(reg.weights) > self.max_bytes:
            raise AdapterRejected(f"The adapter weights are {len(reg.weights)} bytes, over the limit of "
                                  f"{self.max_bytes} (TOKENMILL_MAX_ADAPTER_BYTES).", "weights", "adapter_too_large")
        declared = reg.adapter_config.get("base_model_name_or_path")
        if isinstance(declared, str) and declared in self.models and declared != reg.base_model:
            raise AdapterRejected(f"adapter_config names the base model {declared!r}, not {reg.base_model!r}.",
                                  "adapter_config.base_model_name_or_path", "base_model_mismatch")
        try:
            adapter_files.check_config(reg.adapter_config, self.max_rank)
        except adapter_files.LoraLoadError as exc:
            message = str(exc).replace("the engine's max_lora_rank", "TOKENMILL_MAX_LORA_RANK")
            raise AdapterRejected(message, _config_param(message)) from None
        base = adapter_files.BaseShapes.from_config_json(json.loads((spec.path / "config.json").read_text()))
        with tempfile.TemporaryDirectory(prefix="adapter-check-") as tmp:
            (Path(tmp) / adapter_files.CONFIG_FILE).write_text(json.dumps(reg.adapter_config))
            (Path(tmp) / adapter_files.WEIGHTS_FILE).write_bytes(reg.weights)
            try:
                checked = adapter_files.validate_adapter_dir(tmp, base, self.max_rank, self.max_bytes)
                check_weight_values(str(Path(tmp) / adapter_files.WEIGHTS_FILE), reg.weights, checked)
            except adapter_files.LoraLoadError as exc:
                message = str(exc).replace(tmp + "/", "").replace(tmp, "the adapter")
                if "layers but the base" in message or "in the base model" in message:
                    message += f" (is it an adapter of {reg.base_model}?)"
                raise AdapterRejected(message, "weights") from None
        return checked.rank, checked.target_modules

    def _tenant_lock(self, tenant_id: str) -> threading.Lock:
        with self._locks_lock:
            return self._tenant_locks.setdefault(tenant_id, threading.Lock())

    def _with_recent(self, tenant_id: str, existing: adapters.AdapterCatalog) -> adapters.AdapterCatalog:
        """`existing` and this process's acknowledged registrations of the tenant it may not show yet."""
        view = adapters.AdapterCatalog(manifests=dict(existing.manifests))
        now = time.monotonic()
        for aid, (manifest, at) in list(self._recent.items()):
            if existing.get(aid) is not None or now - at > RECENT_S:
                self._recent.pop(aid, None)  # the view has caught up with it
            elif manifest["tenant_id"] == tenant_id:
                view.manifests[aid] = manifest
        return view

    def register(self, reg: Registration, existing: adapters.AdapterCatalog,
                 checked_files: tuple[int, tuple[str, ...]] | None = None) -> AdapterManifest:
        """Check and store; `checked_files`: check_files' answer for these files, when it ran already."""
        if checked_files is None:
            checked_files = self.check_files(reg)
        rank, targets = checked_files
        with self._tenant_lock(reg.tenant_id):
            self.check_catalog(reg, self._with_recent(reg.tenant_id, existing))
            manifest, chunks = adapters.new_records(
                tenant_id=reg.tenant_id, name=reg.name, base_model=reg.base_model,
                adapter_config=json.dumps(reg.adapter_config, sort_keys=True), weights=reg.weights, rank=rank,
                target_modules=targets)
            self.publisher.publish(manifest, chunks)
            self._recent[manifest["adapter_id"]] = (manifest, time.monotonic())  # type: ignore[assignment]
            return manifest  # type: ignore[return-value]

    def delete(self, tenant_id: str, name: str, existing: adapters.AdapterCatalog) -> AdapterManifest:
        aid = adapters.adapter_id(tenant_id, name)
        with self._tenant_lock(tenant_id):
            found = existing.get(aid) or self._recent.get(aid, (None, 0.0))[0]
            if found is None:
                raise KeyError(name)
            # every chunk of the id the topic holds, of any version: none is left for compaction to keep
            self.publisher.delete(found, existing.chunk_keys_of(aid))
            self._recent.pop(aid, None)
            return found
