"""The grammar-mask kernel against its torch reference: odd vocabularies, bitmasks shorter and longer than the
vocabulary, row subsets, all-allowed and all-forbidden words."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ISAS

from cpu_kernels.token_mask import mask_logits_, mask_logits_reference


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 2048, 2051, 32000])
@pytest.mark.parametrize("extra_words", [-1, 0, 2])
def test_mask_logits_matches_the_reference(vocab, extra_words):
    rng = np.random.default_rng(vocab)
    words = max(1, (vocab + 31) // 32 + extra_words)
    logits = torch.randn(5, vocab)
    rows = [3, 0, 4]
    bits = rng.integers(-2**31, 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    bits[0, :] = -1  # every token of the bitmask allowed
    bits[1, ::2] = 0  # whole words forbidden
    bits[2, -1] = 1  # one token of the last word
    want = mask_logits_reference(logits, bits, rows)
    for isa in ISAS:
        got = mask_logits_(logits.clone(), bits, rows, isa)
        assert torch.equal(got, want), isa
        untouched = [r for r in range(5) if r not in rows]
        assert torch.equal(got[untouched], logits[untouched])
        every = rng.integers(-2**31, 2**31, size=(5, words), dtype=np.int64).astype(np.int32)
        assert torch.equal(mask_logits_(logits.clone(), every, None, isa), mask_logits_reference(logits, every))


def test_mask_logits_checks_its_arguments():
    bits = np.full((1, 1), -1, dtype=np.int32)
    with pytest.raises(ValueError, match="fp32"):
        mask_logits_(torch.zeros(2, 8, dtype=torch.bfloat16), bits, [0])
    with pytest.raises(ValueError, match="int32"):
        mask_logits_(torch.zeros(2, 8), bits.astype(np.int64), [0])
    with pytest.raises(ValueError, match="one row per"):
        mask_logits_(torch.zeros(2, 8), bits, [0, 1])
    with pytest.raises(ValueError, match="distinct rows"):
        mask_logits_(torch.zeros(2, 8), np.full((2, 1), -1, dtype=np.int32), [1, 1])
    with pytest.raises(ValueError, match="distinct rows"):
        mask_logits_(torch.zeros(2, 8), bits, [2])
    with pytest.raises(ValueError, match="distinct rows"):
        mask_logits_(torch.zeros(2, 8), bits, [-1])
