"""A model ingress serves: its tokenizer and context length, and how a request's text becomes
prompt token ids (the same for an HTTP request and a batch line)."""
from __future__ import annotations

import functools
import json

from ingress.serving.checkpoint_tokenizer import load_tokenizer
from infra.config import ModelSpec
from structured_outputs.grammars import GrammarCompiler, compiler_for_checkpoint
from http_api.openai_errors import APIError


class ServedModel:
    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.tokenizer = load_tokenizer(spec.path)
        self.max_model_len = spec.max_model_len
        self.created = int(spec.path.stat().st_mtime)
        self._max_token_bytes = self._longest_token_bytes()

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output schemas for this model's tokenizer (made on first use)."""
        return compiler_for_checkpoint(self.spec.path, self.tokenizer)

    def _longest_token_bytes(self) -> int | None:
        """The most input bytes one token can stand for, or None where that bound does not hold
        (a normalizer may shrink the text before it is split, or the tokenizer is not a fast one)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        # A token's own spelling is never shorter, in UTF-8, than the input it covers: byte-level
        # vocabularies spell each byte as one (1-2 byte) character, SentencePiece spells a space as
        # the 3-byte "\u2581", byte-fallback tokens spell one byte as "<0xAB>".
        return max([len(token.encode("utf-8")) for token in self.tokenizer.get_vocab()] + [1])

    def surely_too_long(self, texts: list[str]) -> bool:
        """True when the text cannot fit the context whatever it tokenizes to: every token covers at
        most the longest token's bytes, so a text of B bytes is at least B / longest tokens. Cheap
        enough to ask before paying for tokenization."""
        if self._max_token_bytes is None:
            return False
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        return size > self.max_model_len * self._max_token_bytes

    def chat_prompt(self, messages, tools=None) -> list[int]:
        turns = [_turn(m) for m in messages]
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        if tool_dicts and "tools" not in (self.tokenizer.chat_template or ""):
            turns, tool_dicts = default_tool_turns(turns, tool_dicts), None
        text = self.tokenizer.apply_chat_template(turns, tools=tool_dicts, add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def text_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
            ids = self.tokenizer.encode(prompt if isinstance(prompt, str) else prompt[0], add_special_tokens=False)
            if not ids:  # "" is a valid prompt (as on OpenAI's API): the text starts from the beginning of a sequence
                if self.tokenizer.bos_token_id is None:
                    raise APIError(400, "The prompt is empty and this model has no start token.", param="prompt",
                                   code="empty_prompt")
                ids = [self.tokenizer.bos_token_id]
            return ids
        vocab = len(self.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is out of the model's vocabulary (size {vocab}).", param="prompt",
                           code="token_out_of_vocabulary")
        return list(prompt)


def _turn(message) -> dict:
    turn = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        turn["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def default_tool_turns(turns: list[dict], tools: list[dict]) -> list[dict]:
    """For a chat template that knows no tools: the tools in a system turn, calls in the history as
    the text the model must answer with (ingress/serving/tool_calls.py), tool results as user turns."""
    listing = "\n".join(json.dumps(t) for t in tools)
    out = [{"role": "system", "content": "You may call these tools. To call one, answer with "
                                         '<tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call>.\n' + listing}]
    for turn in turns:
        content = turn["content"]
        for call in turn.get("tool_calls") or []:
            content += ('<tool_call>{"name": ' + json.dumps(call["function"]["name"]) + ', "arguments": '
                        + call["function"]["arguments"] + "}</tool_call>")
        role = "user" if turn["role"] == "tool" else turn["role"]
        out.append({"role": role, "content": content})
    return out
