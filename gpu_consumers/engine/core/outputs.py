"""What the engine hands back: RequestOutput per step and sequence, GenerateResult (with its Choices)
from the blocking `Engine.generate`."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    choice_index: int
    new_token_ids: list[int]
    first_token_index: int
    text_delta: str
    logprobs: list | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    # why the request could not run (finish_reason LORA_LOAD_FAILED: its adapter could not be loaded)
    error: str | None = None


@dataclass
class Choice:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list | None = None


@dataclass
class GenerateResult:
    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice] = field(default_factory=list)
    cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason
