"""The two kinds of prompt a request can carry: chat messages (`/v1/chat/completions`, and the Responses
API, which runs as a chat completion) and a text prompt (`/v1/completions`). Each knows what it lets
through, the text it holds (for the cheap length check), its token ids and its output constraint; the
submitter and the batch parser take one of them instead of a flag."""
from __future__ import annotations

from typing import Any, Protocol

from http_api.openai_errors import APIError
from ingress.serving.request_builder import structured_spec
from ingress.serving.request_view import ChatView, RequestView, TextView


class PromptTemplates(Protocol):
    """What a prompt kind asks of a model: its prompt's token ids."""

    def chat_prompt(self, messages, tools=None) -> list[int]: ...

    def text_prompt(self, prompt) -> list[int]: ...


class PromptKind(Protocol):
    chat: bool          # the endpoint (chat.completions or completions)
    view: type[RequestView]  # the answer's shape
    id_prefix: str      # of the answer's id
    param: str          # the request field that holds the prompt, for errors

    def refuse_unsupported(self, body) -> None: ...

    def texts(self, body) -> list[str]: ...

    def token_ids(self, model: PromptTemplates, body) -> list[int]: ...

    def constraint(self, body) -> dict[str, Any] | None: ...


class ChatPrompt:
    chat, id_prefix, param = True, "chatcmpl-", "messages"
    view: type[RequestView] = ChatView

    def refuse_unsupported(self, body) -> None:
        pass

    def texts(self, body) -> list[str]:
        return [m.text() for m in body.messages]

    def token_ids(self, model: PromptTemplates, body) -> list[int]:
        return model.chat_prompt(body.messages, body.tools)

    def constraint(self, body) -> dict[str, Any] | None:
        """The structured-output spec the answer is held to (structured_outputs/grammars.py), if any."""
        return structured_spec(body)


class TextPrompt:
    chat, id_prefix, param = False, "cmpl-", "prompt"
    view: type[RequestView] = TextView

    def refuse_unsupported(self, body) -> None:
        if body.echo or (body.best_of or 1) > 1 or body.suffix:
            raise APIError(400, "echo, best_of > 1 and suffix are not supported.", code="unsupported_parameter")

    def texts(self, body) -> list[str]:
        prompt = body.prompt
        if isinstance(prompt, str):
            return [prompt]
        return [prompt[0]] if prompt and isinstance(prompt[0], str) else []

    def token_ids(self, model: PromptTemplates, body) -> list[int]:
        return model.text_prompt(body.prompt)

    def constraint(self, body) -> dict[str, Any] | None:
        return None


def completion_length(model, prompt_ids: list[int], requested: int | None, default: int, param: str) -> int:
    """How many tokens the completion may have: as requested, else what fits up to `default`; a 413
    (naming `param`) when the prompt and the requested completion do not fit the model's context."""
    room = model.max_model_len - len(prompt_ids)
    if room <= 0 or (requested is not None and requested > room):
        raise APIError(413, f"This model's maximum context length is {model.max_model_len} tokens. "
                            f"However, you requested {len(prompt_ids) + (requested or 0)} tokens "
                            f"({len(prompt_ids)} in the prompt, {requested or 0} for the completion).",
                       code="context_length_exceeded", param=param)
    return requested or min(room, default)


CHAT = ChatPrompt()
TEXT = TextPrompt()
