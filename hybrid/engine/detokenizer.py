"""Incremental detokenization with stop strings, holding back text that might become a stop string."""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Feeds generated ids one at a time; `text` is the full completion, `take_delta` what is safe to stream."""

    def __init__(self, backend: BackendTokenizer, stop: list[str], skip_special_tokens: bool = True,
                 min_tokens: int = 0, include_stop: bool = False):
        """Stop strings are looked for once `min_tokens` tokens have come (in the text they add from then); the
        text is cut before the one met, or after it with `include_stop`."""
        self.backend, self.skip_special_tokens, self.include_stop = backend, skip_special_tokens, include_stop
        self.min_tokens, self.tokens = min_tokens, 0
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.last: int | None = None  # the token before, context for a fresh stream
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0

    def step(self, token_id: int) -> str | None:
        """Adds one token; returns the stop string it completed, if any (the text is then cut there)."""
        try:
            chunk = self.stream.step(self.backend, token_id)
        except Exception as e:
            # tokenizers' DecodeStream can meet byte-fallback tokens whose text is not a prefix of the next
            # decode and then raises on every step: start a fresh stream from the token before (the context a
            # SentencePiece decoder needs to keep this token's leading space); the text so far stays.
            if INVALID_PREFIX not in str(e):
                raise
            context = [] if self.last is None else [self.last]
            self.stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
            chunk = self.stream.step(self.backend, token_id)
        self.last = token_id
        self.tokens += 1
        if not chunk:
            return None
        before = len(self.text)
        self.text += chunk
        if self.tokens < self.min_tokens:
            return None
        # Each stop string is looked for where it could end in the new text: one wholly in the text before can
        # only be there from the tokens before min_tokens, which do not stop.
        found = [(at, stop) for stop in self.stop if (at := self.text.find(stop, max(0, before - len(stop) + 1))) != -1]
        if not found:
            return None
        at, stop = min(found)  # the earliest: the text holds no stop string but this one, when included
        self.text = self.text[:at + len(stop) if self.include_stop else at]
        return stop

    def take_delta(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta
