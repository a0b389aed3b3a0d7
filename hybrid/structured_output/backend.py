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

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class GrammarError(ValueError):
    """A grammar (or the JSON schema in it) that cannot be compiled; the message names the problem."""


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
                  vocab_size: int) -> torch.Tensor:
    """closing_rank() per token id, EOS above all."""
    import torch  # here, not above: the api process checks grammars' errors through this module without torch

    ranks = torch.zeros(vocab_size, dtype=torch.int8)
    for i, text in enumerate(token_texts[:vocab_size]):
        ranks[i] = closing_rank(text, added_tokens)
    ranks[[t for t in eos_token_ids if t < vocab_size]] = EOS_RANK
    return ranks


def bitmask_words(vocab_size: int) -> int:
    """The int32 words of one bitmask row over vocab_size tokens."""
    return (vocab_size + 31) // 32


def unpack_bits(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bitmask's rows as [rows, vocab_size] uint8 flags."""
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]  # byte order = token order


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
    closing_rank: torch.Tensor

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

    def allowed(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """A [len(matchers), vocab_size] bool tensor, True where a matcher allows the token next."""
        import torch

        return torch.from_numpy(unpack_bits(self.bitmask(matchers), self.vocab_size)).bool()

    def closing(self, allowed: torch.Tensor) -> torch.Tensor:
        """Of each row's allowed tokens, those of the highest closing rank present."""
        import torch

        ranks = self.closing_rank.to(torch.int16).expand_as(allowed).masked_fill(~allowed, -1)
        return ranks == ranks.max(dim=-1, keepdim=True).values

    def closing_distance(self, matcher: GrammarMatcher, limit: int) -> int:
        """Tokens needed to finish the grammar from matcher's state by always taking the allowed token of the
        highest closing rank (EOS counts as one); limit + 1 when it takes more than limit."""
        m, steps = matcher.copy(), 0
        while steps <= limit and not m.is_finished:
            allowed = self.allowed([m])
            if not allowed.any():
                break
            token = int(self.closing(allowed)[0].nonzero()[0])
            steps += 1
            if self.closing_rank[token] == EOS_RANK or not m.accept(token):
                break
        return steps
