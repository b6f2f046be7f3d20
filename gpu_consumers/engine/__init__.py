"""tokenmill inference engine: continuous batching over a paged KV cache with prefix caching."""

from .config import EngineConfig
from .engine import Choice, Engine, GenerateResult, RequestOutput
from .lora_request import LoraRequest
from .sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "GenerateResult", "Choice", "LoraRequest"]
