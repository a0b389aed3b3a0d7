"""The pass over a step's logits before sampling (cpu_kernels/logits_scan.py) against its torch reference on every
instruction set, fp32 and bf16: odd vocabulary sizes, NaN / +inf / -inf anywhere, every bf16 code, ties, strided
rows, bad inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import ISAS

from cpu_kernels.logits_scan import logits_scan, logits_scan_reference

INF = float("inf")


def check(logits: torch.Tensor) -> None:
    """On fp32 logits and on bf16 ones (the model's own: the sampler scans them unwidened), every instruction set."""
    for x in (logits, logits.bfloat16()):
        want = logits_scan_reference(x.float())
        for isa in ISAS:
            greedy, broken = logits_scan(x, isa=isa)
            assert torch.equal(broken, want[1]), (isa, x.dtype)
            assert torch.equal(greedy, want[0]), (isa, x.dtype)


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
    greedy, broken = logits_scan(wide[:, 7:200])
    assert greedy.tolist() == (wide[:, 7:200].argmax(-1)).tolist() and not broken.any()


@pytest.mark.parametrize("bad", [torch.zeros(10), torch.zeros(2, 10, dtype=torch.float64), torch.zeros(2, 0),
                                 torch.zeros(2, 10, dtype=torch.float16), torch.zeros(1, 2, 3)])
def test_bad_inputs_are_refused(bad):
    with pytest.raises(ValueError, match="logits_scan reads fp32 or bf16 CPU logits"):
        logits_scan(bad)
