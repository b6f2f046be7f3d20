"""tokenmill inference engine: continuous batching over a paged KV cache with prefix caching.

core/ the engine, its scheduler and KV-cache bookkeeping; model/ the Llama composition and the model
runner; layers/ projections, norms, rope and the operations between the products; attention/ paged
attention and its decode backends; quantization/ int8 projections; lora/ adapters; kernels/ the C kernels."""

from .core.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from .core.engine import Engine
from .core.outputs import Choice, GenerateResult, RequestOutput
from .core.sampling_params import SamplingParams
from .core.sequence import LORA_LOAD_FAILED
from .lora.request import LoraRequest
from formats.adapter_files import LoraLoadError

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "GenerateResult", "Choice", "LoraRequest",
           "LoraLoadError", "LORA_LOAD_FAILED", "QUANTIZATIONS", "KV_CACHE_DTYPES"]
