"""The llguidance implementation of the grammar backend.

llguidance builds a grammar's lexer and parser lazily, so making a matcher costs about a millisecond; a pristine
matcher per grammar is kept (LRU) and each request gets a copy of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import numpy as np
from llguidance import LLMatcher

from hybrid.structured_output.backend import GrammarBackend, GrammarError, GrammarMatcher, closing_ranks
from hybrid.tokenizer import Tokenizer

CACHED_GRAMMARS = 64


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: LLMatcher):
        self.m = matcher

    def fill_bitmask(self, bits: np.ndarray, row: int) -> None:
        self.m.unsafe_compute_mask_ptr(bits.ctypes.data + row * bits.strides[0], bits.strides[0])

    def accept(self, token_id: int) -> bool:
        return self.m.consume_token(token_id)

    def allows(self, token_id: int) -> bool:
        return self.m.validate_tokens([token_id]) == 1

    @property
    def is_finished(self) -> bool:
        return self.m.is_stopped()

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.m.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size,
                                                      eos_token=list(eos_token_ids) or None)
        texts = tokenizer.hf.batch_decode([[i] for i in range(min(len(tokenizer.hf), vocab_size))])
        self.closing_rank = closing_ranks(texts, tokenizer.added_tokens, eos_token_ids, vocab_size)
        self._pristine: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, grammar: str) -> None:
        message = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar), self.tokenizer)
        if message:
            raise GrammarError(message.strip())

    def matcher(self, grammar: str) -> GrammarMatcher:
        with self._lock:
            pristine = self._pristine.pop(grammar, None)
        if pristine is None:
            self.check(grammar)
            pristine = LLMatcher(self.tokenizer, LLMatcher.grammar_from_lark(grammar))
            if pristine.is_error():
                raise GrammarError(pristine.get_error())
        with self._lock:
            self._pristine[grammar] = pristine
            while len(self._pristine) > CACHED_GRAMMARS:
                self._pristine.popitem(last=False)
        return LLGuidanceMatcher(pristine.deep_copy())
