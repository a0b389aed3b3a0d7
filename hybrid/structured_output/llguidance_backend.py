"""The llguidance implementation of the grammar backend.

llguidance builds a grammar's lexer and parser lazily, so making a matcher costs about a millisecond; a pristine
matcher per grammar is kept (LRU) and each request gets a copy of it. The closing ranks need every token decoded,
so they are made on first use: the api, which only checks grammars, never pays for them.
"""

from __future__ import annotations

import functools

import llguidance
import llguidance.hf
import numpy as np
from llguidance import LLMatcher

from hybrid.structured_output.backend import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarsUnavailable,
    closing_ranks,
)
from hybrid.tokenizer import Tokenizer

CACHED_GRAMMARS = 64


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: LLMatcher):
        self.m = matcher

    def fill_bitmask(self, bits: np.ndarray, row: int) -> None:
        self.m.unsafe_compute_mask_ptr(bits.ctypes.data + row * bits.strides[0], bits.strides[0])

    def accept(self, token_id: int) -> bool:
        return self.m.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        return self.m.is_stopped()

    @property
    def failure(self) -> str | None:
        return self.m.get_error().strip().splitlines()[0] if self.m.is_error() else None

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.m.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.hf_tokenizer, self.added_tokens, self.eos_token_ids = tokenizer.hf, tokenizer.added_tokens, eos_token_ids
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size,
                                                          eos_token=list(eos_token_ids) or None)
        except Exception as e:  # llguidance reads the tokenizer's decoder and every token's bytes; some it cannot
            raise GrammarsUnavailable("this model's tokenizer cannot be used for structured output: llguidance "
                                      f"cannot read it ({' '.join(str(e).split())[:300]})") from None
        self._pristine = functools.lru_cache(CACHED_GRAMMARS)(self._compile)

    @functools.cached_property
    def closing_rank(self) -> np.ndarray:
        texts = self.hf_tokenizer.batch_decode([[i] for i in range(min(len(self.hf_tokenizer), self.vocab_size))])
        return closing_ranks(texts, self.added_tokens, self.eos_token_ids, self.vocab_size)

    def check(self, grammar: str) -> None:
        message = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar), self.tokenizer)
        if message:
            raise GrammarError(message.strip())
        first = self.matcher(grammar)  # some grammars (one that derives no text) fail only at their first mask
        self.bitmask([first])
        if (reason := first.failure) is not None:
            raise GrammarError(f"no text can follow it from its start ({reason})")

    def _compile(self, grammar: str) -> LLMatcher:
        """A matcher at the grammar's start (constructing it compiles the grammar; errors are not cached)."""
        matcher = LLMatcher(self.tokenizer, LLMatcher.grammar_from_lark(grammar))
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip())
        return matcher

    def matcher(self, grammar: str) -> GrammarMatcher:
        return LLGuidanceMatcher(self._pristine(grammar).deep_copy())
