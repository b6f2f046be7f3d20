"""`POST /v1/completions`: a text prompt (or token ids) in, a text_completion (or its chunks) out."""
from __future__ import annotations

from ingress.api.completion_serving import CompletionServing
from ingress.protocol import CompletionRequest
from ingress.serving.prompts import TEXT


class TextCompletionServing(CompletionServing):
    body_type = CompletionRequest
    prompt = TEXT
