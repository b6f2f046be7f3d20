"""tokenmill inference engine: continuous batching over a paged KV cache with prefix caching."""

from .engine import Choice, Engine, GenerateResult, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "GenerateResult", "Choice"]
