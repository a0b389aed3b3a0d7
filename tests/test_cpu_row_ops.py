"""The row conversions around the dot kernels on every instruction set this CPU runs, against torch: the same
bits everywhere (silu_mul: within its exp's error), over lengths that leave every vector loop a tail."""

import pytest
import torch
from conftest import ISAS

from cpu_kernels import row_ops
from cpu_kernels.pack import Format

LENGTHS = [1, 7, 8, 9, 15, 16, 17, 31, 100, 2053]


def awkward_floats(n: int, seed: int) -> torch.Tensor:
    """Random magnitudes 2^-130..2^127 with both signs, many of them exactly halfway between two bf16 values
    (ties that round to even), and zeros, infinities and NaNs."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * torch.exp2(torch.randint(-130, 127, (n,), generator=g).float())
    bits = v.view(torch.int32)
    tie = torch.rand(n, generator=g) < 0.3
    bits[tie] = (bits[tie] & ~0xFFFF) | 0x8000
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38, 1e-45])
    v[torch.randint(0, n, (min(n, 8),), generator=g)] = special[:min(n, 8)]
    return v


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits, except that any NaN matches any NaN (torch canonicalizes NaN payloads, the kernels keep them)."""
    nan = a.float().isnan()
    assert torch.equal(nan, b.float().isnan())
    assert torch.equal(a[~nan].view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                       b[~nan].view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("n", LENGTHS)
def test_split_and_widen_match_torch(n):
    v = awkward_floats(n, n)
    ref_hi, ref_lo = row_ops.split_bf16_reference(v)
    for isa in ISAS:
        hi, lo = row_ops.split_bf16(v, isa=isa)
        assert_same_bits(hi, ref_hi)
        assert_same_bits(lo, ref_lo)
        hi_only, none = row_ops.split_bf16(v, with_lo=False, isa=isa)
        assert none is None
        assert_same_bits(hi_only, ref_hi)
        assert_same_bits(row_ops.to_f32(hi, isa=isa), hi.float())
        assert_same_bits(row_ops.to_f32(v, isa=isa), v)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-20])
def test_put_matches_torch(n, scale):
    hi = awkward_floats(n, 2 * n)
    lo = torch.randn(n) * hi.abs().clamp(max=1e30) * 2.0**-9
    for dtype in (torch.float32, torch.bfloat16):
        for with_lo in (lo, None):
            ref = row_ops.put_reference(hi, with_lo, scale, dtype)
            for isa in ISAS:
                assert_same_bits(row_ops.put(hi, with_lo, scale, dtype, isa=isa), ref)


@pytest.mark.parametrize("n", LENGTHS)
def test_axpy_tiles_matches_torch(n):
    tiles = (n + 15) // 16
    g = torch.Generator().manual_seed(n)
    for stride in (16, 48):
        hi = torch.randn(tiles, stride, generator=g)
        lo = torch.randn(tiles, stride, generator=g) * 2.0**-9
        acc = torch.randn(n, generator=g)
        for with_lo in (lo, None):
            ref = row_ops.axpy_tiles_reference(0.731, hi, with_lo, acc)
            for isa in ISAS:
                assert_same_bits(row_ops.axpy_tiles(0.731, hi, with_lo, acc, isa=isa), ref)


def test_silu_mul_matches_torch():
    """The vector paths' exp (simd_math.h) is within 2.5e-7 + 8e-8 * |g| of exp where exp(-g) is in fp32's
    range; below g = -87 it stops at e^87, so silu(g) * u comes out as at most |g * u| * e^-87 instead of ~0."""
    g = torch.cat([torch.linspace(-87, 100, 16 * 500), torch.tensor([1e30, 0.0, -0.0, 1e-40] * 4),
                   torch.tensor([-100.0, -1e3, -1e30, -88.0] * 4)])
    u = torch.randn(g.numel(), generator=torch.Generator().manual_seed(0))
    ref = row_ops.silu_mul_reference(g, u)
    inside = g >= -87
    bound = (2.5e-7 + 8e-8 * g.abs()) * ref.abs() + 1e-38
    for isa in ISAS:
        out = torch.cat([row_ops.silu_mul(g[i:i + 16], u[i:i + 16], isa=isa) for i in range(0, g.numel(), 16)])
        assert ((out - ref).abs() <= bound)[inside].all()
        assert ((out - ref).abs() <= (g * u).abs() * 1.7e-38)[~inside].all()


@pytest.mark.parametrize("k", [1, 15, 16, 17, 100, 127, 2048, 2053])
@pytest.mark.parametrize("fmt,group", [(Format.INT8, 16), (Format.INT4, 16), (Format.INT4, 32), (Format.INT4, 128)])
def test_quantize_row_matches_torch(k, fmt, group):
    g = torch.Generator().manual_seed(k)
    kp = (k + group - 1) // group * group
    v = torch.randn(k, generator=g) * 3
    v[::7] = torch.round(v[::7] * 2) / 2  # values that land on .5 after scaling are likelier
    cases = [v, torch.zeros(k), v * 1e-30, v * 1e30]
    for x in cases:
        ref_q, ref_s, ref_gsum = row_ops.quantize_row_reference(x, kp, fmt, group)
        for isa in ISAS:
            q, s, gsum = row_ops.quantize_row(x, kp, fmt, group, isa=isa)
            assert s == ref_s
            assert torch.equal(q, ref_q)
            if fmt == Format.INT4:
                assert torch.equal(gsum, ref_gsum)


def test_quantize_row_ties_round_to_even():
    v = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] + [0.0] * 8)
    for isa in ISAS:
        q, s, _ = row_ops.quantize_row(v, 16, Format.INT4, 16, isa=isa)
        assert s == 1.0
        assert q[:8].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="1-d"):
        row_ops.split_bf16(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="16 values"):
        row_ops.silu_mul(torch.zeros(8), torch.zeros(8))
    with pytest.raises(ValueError, match="multiple of group"):
        row_ops.quantize_row(torch.zeros(20), 24, Format.INT4, 16)
