"""Incremental detokenization with stop strings.

Text deltas are produced by decoding a short sliding window of tokens: the text of
tokens[prefix_offset:] minus the text of tokens[prefix_offset:read_offset].  While
the newest text ends in U+FFFD (an incomplete multi-byte UTF-8 character split
across tokens) nothing is emitted; the bytes are held until the character
completes.  A few prompt tokens seed the window so tokenizers that drop leading
spaces at the start of a decode (SentencePiece) still produce the right spaces.

Stop strings: the full output text is kept; after each delta the new region is
searched for any stop string.  Text that could still turn out to be the start of
a stop string (the last len(longest stop) - 1 characters) is held back, so a
stop string is never emitted.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        ctx = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.tokens: list[int] = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        self.text = ""  # full (decoded) output text, truncated at a stop string
        self.emitted = 0  # chars of self.text already returned
        self.stop = list(stop or [])
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add_tokens(self, token_ids: list[int]) -> None:
        """Feed newly generated tokens; updates self.text (and stop state)."""
        if self.stopped:
            return
        for t in token_ids:
            self.tokens.append(t)
            prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.tokens[self.prefix_offset:])
            if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
                delta = new_text[len(prefix_text):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.tokens)
                self._append_text(delta)
                if self.stopped:
                    return

    def _append_text(self, delta: str) -> None:
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        if self.stop:
            best = -1
            for s in self.stop:
                i = self.text.find(s, start)
                if i != -1 and (best == -1 or i < best):
                    best = i
            if best != -1:
                self.text = self.text[:best]
                self.stopped = True

    def flush(self) -> None:
        """At the end of the sequence: emit bytes held for an incomplete character."""
        if self.stopped:
            return
        if self.read_offset < len(self.tokens):
            prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.tokens[self.prefix_offset:])
            if len(new_text) > len(prefix_text):
                self.read_offset = len(self.tokens)
                self._append_text(new_text[len(prefix_text):])

    def take_delta(self, final: bool) -> str:
        """Text not yet returned; while not final, keeps the stop-string holdback."""
        end = len(self.text) if (final or self.stopped or not self.stop) else max(
            self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
