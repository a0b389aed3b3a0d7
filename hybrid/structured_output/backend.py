"""The interface between the sampler and a grammar library: a backend turns a grammar into matchers, a matcher
follows one request's tokens and says which tokens may come next.

Grammars are Lark text in llguidance's dialect: `%json {schema}` embeds a JSON schema, `<name>` names a
special or added token of the model's tokenizer.

A grammar alone does not make a reply end: a model can stay inside a JSON string for ever. So each backend also
ranks tokens by how much they close (closing_rank). Drawing only among the allowed tokens of the highest rank
present closes strings (or keeps them empty) and containers, and writes commas only where a required key is
still missing; closing_distance() counts the tokens that takes from a matcher's state, and a request starts
closing once its remaining max_tokens come down to that distance (masks.py), so its output ends and parses.
"""

from __future__ import annotations

import functools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A grammar (or the JSON schema in it) that cannot be compiled; the message names the problem."""


class GrammarsUnavailable(GrammarError):
    """The grammar library cannot use the model's tokenizer: no grammar can be enforced on this model."""


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def fill_bitmask(self, bits: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into bits[row], an int32 bitmask (bit t of word t // 32 is token t)."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advances by one sampled token; False when the grammar does not allow it."""

    @property
    @abstractmethod
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (not even a further token before EOS)."""

    @abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state."""

    @property
    @abstractmethod
    def failure(self) -> str | None:
        """Why the grammar itself cannot go on (a limit of the backend met part-way), None where it can."""


EOS_RANK = 4


def is_end_marker(token: str) -> bool:
    return token.startswith("</") or "end" in token.lower()


def closing_rank(text: str, added_tokens: set[str]) -> int:
    """How much a token closes: 3 quotes and brackets starting with a quote (`"`, `"}`: closes a string, or
    opens one that the next quote closes), 2 closing brackets or an added end marker, 1 a comma, else 0."""
    bare = text.strip()
    if text in added_tokens:
        return 2 if is_end_marker(text) else 0
    if bare and set(bare) <= set('"}]'):
        return 3 if bare[0] == '"' else 2
    return 1 if bare == "," else 0


def closing_ranks(token_texts: list[str], added_tokens: set[str], eos_token_ids: list[int],
                  vocab_size: int) -> np.ndarray:
    """closing_rank() per token id (int8 [vocab_size]), EOS above all."""
    ranks = np.zeros(vocab_size, dtype=np.int8)
    for i, text in enumerate(token_texts[:vocab_size]):
        ranks[i] = closing_rank(text, added_tokens)
    ranks[[t for t in eos_token_ids if t < vocab_size]] = EOS_RANK
    return ranks


def bitmask_words(vocab_size: int) -> int:
    """The int32 words of one bitmask row over vocab_size tokens."""
    return (vocab_size + 31) // 32


def unpack_bits(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bitmask's rows as [rows, vocab_size] uint8 flags (how the tests read masks)."""
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]  # byte order = token order


def first_token(row: np.ndarray) -> int | None:
    """The lowest token whose bit is set in one bitmask row, None when none is."""
    words = np.flatnonzero(row)
    if not len(words):
        return None
    word = int(row[words[0]]) & 0xFFFFFFFF
    return int(words[0]) * 32 + (word & -word).bit_length() - 1


def pack_bits(flags: np.ndarray) -> np.ndarray:
    """unpack_bits() undone: [rows, vocab] flags as an int32 bitmask."""
    packed = np.packbits(flags.astype(np.uint8), axis=1, bitorder="little")
    words = np.zeros((flags.shape[0], bitmask_words(flags.shape[1])), dtype=np.int32)
    words.view(np.uint8)[:, :packed.shape[1]] = packed
    return words


class GrammarBackend(ABC):
    """Compiles grammars for one tokenizer and vocabulary width (the model's logits). `closing_rank` is
    closing_ranks() of its tokenizer."""

    vocab_size: int
    closing_rank: np.ndarray

    @abstractmethod
    def check(self, grammar: str) -> None:
        """Raises GrammarError naming what is wrong with the grammar."""

    @abstractmethod
    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; raises GrammarError."""

    def bitmask(self, matchers: list[GrammarMatcher]) -> np.ndarray:
        """A [len(matchers), words] int32 bitmask (words = ceil(vocab_size / 32)), row i matchers[i]'s."""
        bits = np.zeros((len(matchers), bitmask_words(self.vocab_size)), dtype=np.int32)
        for row, m in enumerate(matchers):
            m.fill_bitmask(bits, row)
        return bits

    @functools.cached_property
    def rank_bits(self) -> np.ndarray:
        """[EOS_RANK + 1, words] int32: row r the bitmask of the tokens of closing rank r."""
        return pack_bits(self.closing_rank[None, :] == np.arange(EOS_RANK + 1)[:, None])

    def closing(self, bits: np.ndarray) -> np.ndarray:
        """Of each bitmask row's allowed tokens, those of the highest closing rank present (none where none is)."""
        hits = bits[:, None, :] & self.rank_bits[None]  # [rows, ranks, words]
        top = EOS_RANK - hits.any(axis=2)[:, ::-1].argmax(axis=1)
        return hits[np.arange(len(bits)), top]

    def closing_distance(self, matcher: GrammarMatcher, limit: int) -> int:
        """Tokens needed to finish the grammar from matcher's state by always taking the allowed token of the
        highest closing rank (EOS counts as one); limit + 1 when it takes more than limit."""
        m, steps = matcher.copy(), 0
        while steps <= limit and not m.is_finished:
            token = first_token(self.closing(self.bitmask([m]))[0])
            if token is None:
                break
            steps += 1
            if self.closing_rank[token] == EOS_RANK or not m.accept(token):
                break
        return steps


class LazyBackend:
    """A process's grammar backend, made at its first use (building it reads the whole vocabulary). A tokenizer
    the library cannot use is remembered and logged once: it does not change, and neither would the answer."""

    def __init__(self, make: Callable[[], GrammarBackend]):
        self._make = make
        self._lock = threading.Lock()
        self._backend: GrammarBackend | None = None
        self._unavailable: GrammarsUnavailable | None = None

    def get(self) -> GrammarBackend:
        """The backend; raises GrammarsUnavailable."""
        with self._lock:
            if self._unavailable is not None:
                raise self._unavailable
            if self._backend is None:
                try:
                    self._backend = self._make()
                except GrammarsUnavailable as e:
                    log.warning("structured output is unavailable on this model: %s", e)
                    self._unavailable = e
                    raise
            return self._backend
