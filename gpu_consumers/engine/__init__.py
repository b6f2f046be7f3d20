"""tokenmill inference engine: continuous batching over a paged KV cache with prefix caching."""

from .config import EngineConfig
from .engine import Choice, Engine, GenerateResult, RequestOutput
from .lora_request import LoraRequest
from formats.adapter_files import LoraLoadError
from .sampling_params import SamplingParams
from .sequence import LORA_LOAD_FAILED

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "GenerateResult", "Choice", "LoraRequest",
           "LoraLoadError", "LORA_LOAD_FAILED"]
