"""Next-token masks for a batch of matchers: which tokens each grammar allows, narrowed to the best closing tokens
for the requests that must start finishing their grammar because max_tokens is near (backend.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybrid.structured_output.backend import GrammarBackend, GrammarMatcher

# A request checks whether it must start closing its grammar over its last CLOSING_HORIZON tokens, and starts
# CLOSING_MARGIN tokens early: the model's pick among the closing tokens may take a few more than counted.
CLOSING_HORIZON = 96
CLOSING_MARGIN = 4


@dataclass
class NextTokenMasks:
    """Row i of the int32 bitmask is the i-th matcher's allowed next tokens; closing[i] whether it is closing
    (it stays so)."""

    bits: np.ndarray
    closing: list[bool]


def must_close(backend: GrammarBackend, matcher: GrammarMatcher, left: int, closing: bool) -> bool:
    """Whether a request with `left` tokens to go must draw only closing tokens from now on."""
    return closing or (left <= CLOSING_HORIZON and left <= backend.closing_distance(matcher, left) + CLOSING_MARGIN)


def next_token_masks(backend: GrammarBackend, matchers: list[GrammarMatcher], left: list[int],
                     closing: list[bool]) -> NextTokenMasks:
    closing = [must_close(backend, m, n, c) for m, n, c in zip(matchers, left, closing)]
    bits = backend.bitmask(matchers)
    rows = [i for i, c in enumerate(closing) if c]
    if rows:
        bits[rows] = backend.closing(bits[rows])
    return NextTokenMasks(bits, closing)
