"""`POST /v1/chat/completions`: chat messages in, a chat.completion (or its chunks) out."""
from __future__ import annotations

from ingress.api.completion_serving import CompletionServing
from ingress.protocol import ChatCompletionRequest
from ingress.serving.prompts import CHAT


class ChatServing(CompletionServing):
    body_type = ChatCompletionRequest
    prompt = CHAT
