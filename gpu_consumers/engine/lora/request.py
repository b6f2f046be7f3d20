"""LoraRequest: which LoRA adapter a request runs with, as the engine is handed it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraRequest:
    """``adapter_id`` names the adapter everywhere (the model id suffix, e.g. ``acme-support``, made
    unique per tenant by the registry: ``<tenant>/<name>``); ``path`` is a local directory in PEFT's
    format (``adapter_config.json`` + ``adapter_model.safetensors``) the engine loads it from the first
    time a request needs it. Two requests with the same ``adapter_id`` share one loaded adapter."""

    adapter_id: str
    path: str
