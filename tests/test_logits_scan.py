"""The pass over a step's logits before sampling (cpu_kernels/logits_scan.py) against its torch reference on every
instruction set, fp32 and bf16: odd vocabulary sizes, NaN / +inf / -inf anywhere, every bf16 code, ties, strided
rows, bad inputs; and with grammar masks: bitmasks shorter and longer than the vocabulary, row subsets, all-allowed
and all-forbidden words, masks that leave nothing, special values under the mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ISAS

from cpu_kernels.logits_scan import BROKEN, MASKED_OUT, OK, logits_scan, logits_scan_reference

INF = float("inf")


def check(logits: torch.Tensor) -> None:
    """On fp32 logits and on bf16 ones (the model's own: the sampler scans them unwidened), every instruction set."""
    for x in (logits, logits.bfloat16()):
        want = logits_scan_reference(x)[:2]
        for isa in ISAS:
            assert logits_scan(x, isa=isa) == want, (isa, x.dtype)


def check_masked(logits: torch.Tensor, bits: np.ndarray, rows: list[int] | None) -> None:
    """The masked scan against the reference on every instruction set, fp32 and bf16: statuses, greedy tokens,
    the logits left."""
    for x in (logits, logits.bfloat16()):
        greedy, status, masked = logits_scan_reference(x, bits, rows)
        for isa in ISAS:
            got = x.clone()
            assert logits_scan(got, bits, rows, isa) == (greedy, status), (isa, x.dtype)
            torch.testing.assert_close(got, masked, rtol=0, atol=0, equal_nan=True, msg=f"isa {isa}, {x.dtype}")


@pytest.mark.parametrize("vocab", [1, 2, 15, 16, 17, 31, 33, 1000, 32003, 151936])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_random_rows(rows, vocab):
    g = torch.Generator().manual_seed(rows * 100003 + vocab)
    check(torch.randn(rows, vocab, generator=g) * 10)


def test_every_bf16_value_scans_as_its_fp32_widening():
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # NaNs and infinities too
    finite = codes[torch.isfinite(codes)]
    check(finite.unsqueeze(0))  # every finite code in one row
    check(finite[:5 * 13005].view(5, 13005)[:, torch.randperm(13005, generator=torch.Generator().manual_seed(1))])
    check(codes.view(8, -1))  # every row holds a NaN or an infinity


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 40, 333])
def test_special_values_anywhere(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = []
    for pos in sorted({0, vocab // 2, vocab - 1}):
        for value in (float("nan"), INF, -INF):
            row = torch.randn(vocab, generator=g)
            row[pos] = value
            rows.append(row)
    rows.append(torch.full((vocab,), -INF))
    rows.append(torch.full((vocab,), -INF).index_fill_(0, torch.tensor([vocab - 1]), 3.0))
    rows.append(torch.full((vocab,), float("nan")))
    rows.append(torch.full((vocab,), INF))
    check(torch.stack(rows))


@pytest.mark.parametrize("vocab", [7, 16, 50, 1001])
def test_ties_give_the_first_index(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 3, (12, vocab), generator=g).float()  # many equal maxima, across vector lanes
    x[0] = 2.0
    x[1, vocab - 1] = 9.0
    x[1, max(vocab - 17, 0)] = 9.0
    x[2] = torch.finfo(torch.float32).max
    x[3] = -torch.finfo(torch.float32).max
    check(x)


def test_strided_and_transposed_rows():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 300, generator=g)
    check(wide[:, 7:200])  # rows 300 floats apart
    check(wide[::2, :99])
    check(torch.randn(64, 9, generator=g).t())  # columns not contiguous: scanned from a copy
    greedy, status = logits_scan(wide[:, 7:200])
    assert greedy == wide[:, 7:200].argmax(-1).tolist() and status == [OK] * 5


def random_bits(rng: np.random.Generator, rows: int, words: int) -> np.ndarray:
    return rng.integers(-2**31, 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 31, 32, 33, 100, 2048, 2051, 32000, 151936])
@pytest.mark.parametrize("extra_words", [-1, 0, 2])
def test_masks_match_the_reference(vocab, extra_words):
    rng = np.random.default_rng(vocab)
    words = max(1, (vocab + 31) // 32 + extra_words)
    logits = torch.from_numpy(rng.standard_normal((5, vocab), dtype=np.float32))
    rows = [3, 0, 4]
    bits = random_bits(rng, len(rows), words)
    bits[0, :] = -1  # every token of the bitmask allowed
    bits[1, ::2] = 0  # whole words forbidden
    bits[2, -1] = 1  # one token of the last word
    check_masked(logits, bits, rows)
    check_masked(logits, random_bits(rng, 5, words), None)


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 40, 333])
def test_masks_over_special_values(vocab):
    """A NaN or +inf breaks a row also where the mask forbids it; -inf where it allows leaves other tokens; a mask
    that keeps only -inf logits, or nothing, leaves the row masked out, not broken."""
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    rows, masks = [], []
    for pos in sorted({0, vocab // 2, vocab - 1}):
        for value in (float("nan"), INF, -INF):
            for allowed in (True, False):
                row = torch.from_numpy(rng.standard_normal(vocab, dtype=np.float32))
                row[pos] = value
                mask = random_bits(rng, 1, words)[0]
                mask[pos // 32] = mask[pos // 32] | (1 << pos % 32) if allowed else mask[pos // 32] & ~(1 << pos % 32)
                rows.append(row)
                masks.append(mask)
    rows.append(torch.full((vocab,), -INF).index_fill_(0, torch.tensor([vocab - 1]), 3.0))
    masks.append(np.full(words, -1, dtype=np.int32) ^ np.int32(1 << (vocab - 1) % 32) * (np.arange(words) == words - 1))
    rows.append(torch.from_numpy(rng.standard_normal(vocab, dtype=np.float32)))
    masks.append(np.zeros(words, dtype=np.int32))
    rows.append(torch.full((vocab,), -INF))
    masks.append(np.full(words, -1, dtype=np.int32))
    logits, bits = torch.stack(rows), np.stack(masks).astype(np.int32)
    check_masked(logits, bits, None)
    _, status, _ = logits_scan_reference(logits, bits)
    assert status[-3:] == [MASKED_OUT, MASKED_OUT, BROKEN]
    assert BROKEN in status[:-3] and (OK in status[:-3] or vocab == 1)  # one token: the special value is all


def test_masks_on_strided_rows():
    rng = np.random.default_rng(5)
    wide = torch.from_numpy(rng.standard_normal((5, 300), dtype=np.float32))
    check_masked(wide[:, 7:200], random_bits(rng, 3, 7), [4, 1, 2])  # rows 300 floats apart
    got = wide.clone()
    logits_scan(got[:, 7:200], np.zeros((5, 7), dtype=np.int32))
    assert torch.equal(got[:, :7], wide[:, :7]) and torch.equal(got[:, 200:], wide[:, 200:])  # outside: untouched


def test_unmasked_rows_beside_masked_ones_scan_as_alone():
    rng = np.random.default_rng(7)
    logits = torch.from_numpy(rng.standard_normal((6, 77), dtype=np.float32))
    logits[1, 3] = float("nan")
    got = logits.clone()
    greedy, status = logits_scan(got, np.zeros((2, 3), dtype=np.int32), [4, 2])
    alone = logits_scan(logits)
    assert [greedy[r] for r in (0, 1, 3, 5)] == [alone[0][r] for r in (0, 1, 3, 5)]
    assert status == [OK, BROKEN, MASKED_OUT, OK, MASKED_OUT, OK]
    torch.testing.assert_close(got[[0, 1, 3, 5]], logits[[0, 1, 3, 5]], rtol=0, atol=0, equal_nan=True)
    assert torch.isneginf(got[[2, 4]]).all()


def test_masked_scans_check_their_arguments():
    bits = np.full((1, 1), -1, dtype=np.int32)
    with pytest.raises(ValueError, match="contiguous, separate rows"):
        logits_scan(torch.zeros(8, 2).t(), bits, [0])
    with pytest.raises(ValueError, match="contiguous, separate rows"):
        logits_scan(torch.zeros(1, 8).expand(2, 8), bits, [0])
    with pytest.raises(ValueError, match="int32"):
        logits_scan(torch.zeros(2, 8), bits.astype(np.int64), [0])
    with pytest.raises(ValueError, match="one row per"):
        logits_scan(torch.zeros(2, 8), bits, [0, 1])
    with pytest.raises(ValueError, match="one row per"):
        logits_scan(torch.zeros(2, 8), bits)
    with pytest.raises(ValueError, match="distinct rows"):
        logits_scan(torch.zeros(2, 8), np.full((2, 1), -1, dtype=np.int32), [1, 1])
    with pytest.raises(ValueError, match="distinct rows"):
        logits_scan(torch.zeros(2, 8), bits, [2])
    with pytest.raises(ValueError, match="distinct rows"):
        logits_scan(torch.zeros(2, 8), bits, [-1])


@pytest.mark.parametrize("bad", [torch.zeros(10), torch.zeros(2, 10, dtype=torch.float64), torch.zeros(2, 0),
                                 torch.zeros(2, 10, dtype=torch.float16), torch.zeros(1, 2, 3)])
def test_bad_inputs_are_refused(bad):
    with pytest.raises(ValueError, match="logits_scan reads fp32 or bf16 CPU logits"):
        logits_scan(bad)
