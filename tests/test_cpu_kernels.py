"""The C++ kernels against pure-torch references: every format, odd shapes, every instruction-set path."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from conftest import ISAS

from cpu_kernels import _C
from cpu_kernels.cpu_features import best_path
from cpu_kernels.linear import PackedLinear, linear, linear_reference
from cpu_kernels.moe import (
    ISA_AMX,
    ISA_AVX512_BF16,
    ISA_GENERIC,
    fp8_lines_to_bf16,
    fused_moe,
    fused_moe_reference,
    pack_experts,
    unpack_experts,
)
from cpu_kernels.pack import (
    Format,
    fp8_pair_flags,
    fp8_pair_flags_reference,
    pack_matrix,
    packed_bytes,
    padded_k,
    quantize_fp8_blocks,
    tile_lines,
    tile_lines_reference,
    unpack_matrix,
)

FORMATS = ["bf16", "fp8", "int8", "int4"]
# Relative L2 error bounds. bf16/fp8 weights are exact in the kernels, so with fp32 activations (carried as
# bf16 hi + lo) only summation order differs; bf16 activations round inputs and the SiLU product to bf16.
# int8/int4 quantize activations per token to int8 (weights are compared after their own quantization).
BOUND = {("bf16", torch.float32): 1e-4, ("fp8", torch.float32): 1e-4,
         ("bf16", torch.bfloat16): 1e-2, ("fp8", torch.bfloat16): 1e-2}
INT_BOUND = 3e-2


def amx_rows(fmt: str, dtype: torch.dtype, tokens: int) -> bool:
    """Whether a block of `tokens` rows goes to the AMX kernels (csrc/moe.cpp amx_rows); fp32 inputs to
    bf16/fp8 weights travel as two rows each."""
    rows = tokens * (2 if dtype == torch.float32 and fmt in ("bf16", "fp8") else 1)
    return rows >= {"int4": 12, "int8": 8}.get(fmt, 4)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def experts(e: int, h: int, i: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g) / s[-1] ** 0.5  # noqa: E731
    return [mk(i, h) for _ in range(e)], [mk(i, h) for _ in range(e)], [mk(h, i) for _ in range(e)]


def routing(t: int, e: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    return ids.long(), torch.rand(t, k, generator=g)


# (experts, hidden, intermediate, top-k, tokens): odd sizes, k = 1..8, T = 1..600, idle experts.
MOE_CASES = [(4, 64, 32, 1, 1), (6, 130, 50, 3, 7), (8, 200, 72, 8, 33), (16, 96, 40, 2, 3), (5, 256, 128, 4, 129),
             (3, 33, 17, 2, 600), (12, 160, 96, 6, 20), (9, 48, 144, 5, 2)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: "E{}-H{}-I{}-k{}-T{}".format(*c))
def test_fused_moe_matches_reference(fmt, case):
    e, h, i, k, t = case
    p = pack_experts(*experts(e, h, i, seed=t), fmt)
    w13, w2 = unpack_experts(p)
    ids, weights = routing(t, e, k, seed=t + 1)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(7))
    for isa in ISAS:
        for dtype in (torch.float32, torch.bfloat16):
            if isa == ISA_GENERIC and t > 200 and dtype == torch.bfloat16:
                continue
            xin = x.to(dtype)
            out = fused_moe(p, xin, ids, weights, scale=1.5, isa=isa)
            ref = fused_moe_reference(w13, w2, xin.float(), ids, weights, scale=1.5)
            assert out.dtype == dtype and out.shape == x.shape
            bound = BOUND.get((fmt, dtype), INT_BOUND)
            assert rel_err(out, ref) < bound, (isa, dtype)


def test_isa_paths_agree_and_threads_are_deterministic():
    p = pack_experts(*experts(8, 130, 70, seed=1), "fp8")
    ids, weights = routing(40, 8, 3, seed=2)
    x = torch.randn(40, 130).to(torch.bfloat16)
    one = fused_moe(p, x, ids, weights, num_threads=1)
    assert torch.equal(one, fused_moe(p, x, ids, weights, num_threads=2))
    assert torch.equal(one, fused_moe(p, x, ids, weights, num_threads=1))
    best = ISAS[-1]  # ISAS is in order of preference
    if best == ISA_GENERIC:
        pytest.skip("only the generic path runs here: there is no second path to agree with")
    assert rel_err(fused_moe(p, x, ids, weights, isa=ISA_GENERIC), fused_moe(p, x, ids, weights, isa=best)) < 5e-3


def test_every_fp8_code_converts_exactly():
    codes = torch.arange(256, dtype=torch.uint8).repeat(8).view(16, 128)
    w8 = codes.view(torch.float8_e4m3fn)
    packed = pack_matrix(w8, "fp8", scale_inv=torch.ones(1, 1))
    expected = pack_matrix(w8.to(torch.bfloat16), "bf16").data.view(torch.int16).flatten()
    nan = torch.isnan(expected.view(torch.bfloat16))
    assert nan.sum() == 16 * 128 // 128 and codes.view(-1)[127] == 127  # codes 0x7f and 0xff, 8 times each
    for isa in ISAS:
        out = fp8_lines_to_bf16(packed.data, isa=isa)
        assert torch.equal(torch.isnan(out), nan)
        assert torch.equal(out.view(torch.int16)[~nan], expected[~nan])


def test_fp8_values_through_a_full_linear():
    # Every finite code, each alone in its row, times a one-hot input reproduces the code's value.
    finite = [c for c in range(256) if c & 0x7F != 0x7F]
    w8 = torch.zeros(len(finite), 128, dtype=torch.uint8)
    for row, c in enumerate(finite):
        w8[row, row % 128] = c
    w8 = w8.view(torch.float8_e4m3fn)
    scale = torch.full((-(-len(finite) // 128), 1), 0.5)
    p = PackedLinear.pack(w8, "fp8", scale_inv=scale)
    x = torch.eye(128)
    expected = (w8.float() * 0.5).t()
    for isa in ISAS:
        # fp32 tokens meet unscaled bf16 lines; bf16 tokens lines with the block scale multiplied in
        assert torch.equal(linear(p, x, isa=isa), expected)
        assert torch.equal(linear(p, x.to(torch.bfloat16), isa=isa), expected.to(torch.bfloat16))


@pytest.mark.parametrize("tokens", [1, 2, 5, 7, 128])
def test_every_fp8_code_through_the_bit_map_conversion(tokens):
    # Few-token kernels convert codes with GF(2) bit maps, and so do the prefill / AMX paths where they
    # multiply the block scales into bf16 lines (bf16 tokens); both fall back to the tables for line pairs
    # holding a zero, subnormal or NaN code. Code c sits alone at row c among 2.0s (which take the bit maps),
    # so one-hot tokens read single products: each code's value exactly; rows 0x7f and 0xff are NaN (as
    # torch's matmul, NaN times 0 included).
    codes = torch.full((256, 128), 0x40, dtype=torch.uint8)
    codes[torch.arange(256), torch.arange(256) % 128] = torch.arange(256, dtype=torch.uint8)
    w8 = codes.view(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5], [0.25]])
    p = PackedLinear.pack(w8, "fp8", scale_inv=scale)
    w = w8.float() * scale.repeat_interleave(128, 0)
    for isa in ISAS:
        for c0 in range(0, 128, tokens):
            x = torch.eye(128)[c0:c0 + tokens]
            before = _C.amx_calls()
            out = linear(p, x.to(torch.bfloat16), isa=isa).float()
            assert (_C.amx_calls() > before) == (isa == ISA_AMX and len(x) >= 4)
            want = x @ w.t()
            nan = torch.isnan(want)
            assert nan[:, [127, 255]].all() and nan.sum() == 2 * len(x)
            assert torch.equal(torch.isnan(out), nan), (isa, c0)
            assert torch.equal(out[~nan], want[~nan].to(torch.bfloat16).float()), (isa, c0)


@pytest.mark.parametrize("magnitude", [2.0 ** 40, 2.0 ** 100, 2.0 ** -100])
def test_fp8_products_of_huge_and_tiny_activations_are_exact(magnitude):
    # The avx2 path meets raw weights (values * 2^-120) with activations scaled by 2^96 unless a row holds a
    # value of 2^32 or more, where it scales the weights instead; either way one-hot tokens read each weight
    # times the activation exactly, subnormal codes included.
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (32, 256), generator=g, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0x01
    w8 = codes.view(torch.float8_e4m3fn)
    p = PackedLinear.pack(w8, "fp8", scale_inv=torch.tensor([[1.0, 0.5]]))
    w = w8.float() * torch.tensor([1.0, 0.5]).repeat_interleave(128)
    for tokens in (1, 2, 3, 4, 5):
        for c in (0, 77, 200):
            x = torch.zeros(tokens, 256, dtype=torch.bfloat16)
            x[:, c] = magnitude
            x[1:, (c + 5) % 256] = 1.0
            want = (x.float() @ w.t()).to(torch.bfloat16).float()
            for isa in ISAS:
                assert torch.equal(linear(p, x, isa=isa).float(), want), (isa, tokens, c)


@pytest.mark.parametrize("tokens", [1, 3, 5, 20, 40])
def test_flagged_fp8_line_pairs_anywhere_in_long_rows(tokens):
    # The packer flags each line pair holding a zero / subnormal / NaN code; the kernels read those flags at
    # the pair's offset, also from column ranges of a tile (AMX k steps, prefill chunks of 1024 columns).
    # Zeros sit at 64 places among 2.0s across 1536 columns; one-hot tokens read each weight alone, so a
    # zero taken by the bit maps (which make it 2^-7) shows.
    n, k = 32, 1536
    codes = torch.full((n, k), 0x40, dtype=torch.uint8)
    cols = torch.tensor([(r * 97 + j * 389) % k for r in range(16) for j in range(4)])
    codes[torch.arange(64) % n, cols] = 0
    w8 = codes.view(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5, 2.0, 0.25, 1.0, 4.0, 0.5, 0.125, 8.0, 1.0, 0.5, 2.0, 0.25]])  # per 128 columns
    p = PackedLinear.pack(w8, "fp8", scale_inv=scale)
    w = w8.float() * scale.repeat_interleave(128, 1)
    picks = torch.cat([cols, torch.arange(0, k, 37)])
    for isa in ISAS:
        for i in range(0, len(picks), tokens):
            x = torch.eye(k)[picks[i:i + tokens]].to(torch.bfloat16)
            assert torch.equal(linear(p, x, isa=isa).float(), x.float() @ w.t()), (isa, i)


@pytest.mark.parametrize("k", [8, 16, 120, 128, 520, 2048])
def test_fp8_pair_flags_match_torch(k):
    g = torch.Generator().manual_seed(k)
    codes = (torch.randint(0x18, 0x70, (40, k), generator=g, dtype=torch.uint8)
             | (torch.randint(0, 2, (40, k), generator=g, dtype=torch.uint8) << 7))
    odd = torch.tensor([0x00, 0x80, 0x01, 0x07, 0x08, 0x0E, 0x7F, 0xFF], dtype=torch.uint8)
    spots = torch.randint(0, 40 * k, (max(1, k // 16),), generator=g)
    codes.view(-1)[spots] = odd[torch.arange(len(spots)) % len(odd)]
    w8 = codes.view(torch.float8_e4m3fn)
    kp = padded_k(Format.FP8, k, block_k=16)
    lines = tile_lines(w8, kp, Format.FP8)
    flags = fp8_pair_flags(lines, kp)
    assert flags.shape == (3, -(-kp // 64))
    assert torch.equal(flags, fp8_pair_flags_reference(lines, kp))
    # e = 1 codes with m = 7 and every larger code take the bit maps
    assert not fp8_pair_flags(tile_lines(torch.full((16, 16), 0x0F, dtype=torch.uint8).view(torch.float8_e4m3fn),
                                         16, Format.FP8), 16).any()


@pytest.mark.amx
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("t", [4, 5, 8, 20, 32, 33, 70, 300])
def test_amx_column_steps_match_avx512(fmt, t):
    # bf16 tokens against bf16 / fp8 tiles run tile_span_amx: 1024 columns per step (fewer for many rows: 300
    # rows take 832 / 768 for bf16 / fp8), tiles two at a time (90 outputs: five whole tiles and a partial
    # one), fp8 converted a k step at a time up to 32 rows and a pair's column step at a time above.
    g = torch.Generator().manual_seed(t)
    w = torch.randn(90, 2000, generator=g) / 2000 ** 0.5
    x = torch.randn(t, 2000, generator=g).to(torch.bfloat16)
    p = PackedLinear.pack(w, fmt)
    before = _C.amx_calls()
    out = linear(p, x, isa=ISA_AMX)
    assert _C.amx_calls() > before
    assert rel_err(out, linear(p, x, isa=ISA_AVX512_BF16)) < 4e-3
    assert rel_err(out, linear_reference(p, x.float())) < BOUND[(fmt, torch.bfloat16)]


def test_fp8_nan_codes_give_nan_on_every_path():
    w8 = torch.zeros(16, 128, dtype=torch.uint8)
    w8[3, 5], w8[9, 70] = 0x7F, 0xFF
    p = PackedLinear.pack(w8.view(torch.float8_e4m3fn), "fp8", scale_inv=torch.ones(1, 1))
    for isa in ISAS:
        out = linear(p, torch.ones(20, 128), isa=isa)  # 20 tokens: an AMX block and a half on the amx path
        assert torch.equal(torch.isnan(out), torch.tensor([r in (3, 9) for r in range(16)]).expand(20, 16)), isa


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,t", [(33, 70, 1), (256, 512, 5), (100, 130, 40), (17, 300, 9), (33, 64, 33),
                                   (64, 128, 47), (48, 2048, 40), (40, 4096, 21)])
def test_linear_matches_reference(fmt, n, k, t):
    # From 8 rows (int4: 12) the amx path runs AMX tiles, most cases with a partial row block; bf16 inputs
    # with k a multiple of the padding are read in place there. The avx512 and avx2 paths widen long rows a
    # block at a time (k = 4096: fp8 8 + 8 + 5 and 10 + 10 + 1 rows, bf16 16 + 5 and 20 + 1).
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) / k ** 0.5
    p = PackedLinear.pack(w, fmt)
    x = torch.randn(t, k)
    for isa in ISAS:
        for dtype in (torch.float32, torch.bfloat16):
            before = _C.amx_calls()
            out = linear(p, x.to(dtype), isa=isa)
            assert (_C.amx_calls() > before) == (isa == ISA_AMX and amx_rows(fmt, dtype, t))
            assert out.shape == (t, n) and out.dtype == dtype
            assert rel_err(out, linear_reference(p, x.to(dtype).float())) < BOUND.get((fmt, dtype), INT_BOUND)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stacked_matrix_gives_each_part_the_same_bits(fmt):
    # q / k / v (gate / up) packed as one matrix (hybrid.layers.linear.SharedInputLinears): every output
    # row is computed as it is in its own matrix. fp8 parts stack along whole 128-row scale blocks.
    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(n, 300, generator=g) / 17 for n in (256, 128, 128)]
    if fmt == "fp8":
        quantized = [quantize_fp8_blocks(w) for w in parts]
        alone = [PackedLinear.pack(q, fmt, scale_inv=s) for q, s in quantized]
        stacked = PackedLinear.pack(torch.cat([q for q, _ in quantized]), fmt,
                                    scale_inv=torch.cat([s for _, s in quantized]))
    else:
        alone = [PackedLinear.pack(w, fmt) for w in parts]
        stacked = PackedLinear.pack(torch.cat(parts), fmt)
    for t in (1, 3, 40):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(t, 300, generator=g).to(dtype)
            for isa in ISAS:
                ours = linear(stacked, x, isa=isa).split([256, 128, 128], dim=-1)
                assert all(torch.equal(a, linear(p, x, isa=isa)) for a, p in zip(ours, alone)), (t, dtype, isa)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_bytes_without_packing(fmt):
    """What the planner counts for a matrix it does not load: the bytes pack_matrix gives it, padding included."""
    for n, k in [(1, 1), (16, 128), (17, 130), (45, 300), (100, 1000), (64, 64)]:
        for block_k in (128, 256):
            p = pack_matrix(torch.randn(n, k), fmt, block=(128, block_k))
            got = sum(t.numel() * t.element_size() for t in (p.data, p.scales, p.comp, p.flags) if t is not None)
            assert packed_bytes(fmt, n, k, block_k=block_k) == got, (n, k, block_k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_round_trip(fmt):
    w = torch.randn(45, 300)
    back = unpack_matrix(pack_matrix(w, fmt))
    tol = {"bf16": 1e-2, "fp8": 7e-2, "int8": 1e-2, "int4": 0.15}[fmt]
    assert back.shape == w.shape
    assert rel_err(back, w) < tol


@pytest.mark.parametrize("fmt,dtype", [(Format.FP8, torch.float8_e4m3fn), (Format.BF16, torch.bfloat16),
                                       (Format.INT8, torch.int8)], ids=["fp8", "bf16", "int8"])
@pytest.mark.parametrize("n,k", [(1, 1), (15, 7), (16, 128), (33, 130), (100, 257), (7, 1001)])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "strided"])
def test_tile_lines_match_torch_permutation(fmt, dtype, n, k, transposed):
    src = torch.randn(k, n).t() if transposed else torch.randn(n, k)
    w = (src * 40).to(torch.int8) if dtype == torch.int8 else src.to(dtype)
    kp = padded_k(fmt, k)
    assert torch.equal(tile_lines(w, kp, fmt), tile_lines_reference(w, kp, fmt))


def test_native_fp8_pack_is_lossless():
    w = torch.randn(300, 260)
    q, s = quantize_fp8_blocks(w)
    back = unpack_matrix(pack_matrix(q, "fp8", scale_inv=s))
    ref = q.float() * s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    assert torch.equal(back, ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dropped_slots_are_neither_run_nor_summed(fmt):
    e, h, i, k, t = 8, 96, 40, 4, 21
    p = pack_experts(*experts(e, h, i, seed=3), fmt)
    w13, w2 = unpack_experts(p)
    ids, weights = routing(t, e, k, seed=4)
    ids[ids < 3] = -1  # experts 0-2 "live on the GPU"
    ids[5] = -1  # a token with every slot elsewhere
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5))
    for isa in ISAS:
        out = fused_moe(p, x, ids, weights, isa=isa)
        ref = fused_moe_reference(w13, w2, x, ids, weights)
        assert rel_err(out, ref) < BOUND.get((fmt, torch.float32), INT_BOUND)
        assert torch.equal(out[5], torch.zeros(h))
    assert torch.equal(fused_moe(p, x[:2], torch.full((2, k), -1), weights[:2]), torch.zeros(2, h))


def test_bad_inputs_are_rejected():
    p = pack_experts(*experts(4, 64, 32, seed=0), "bf16")
    x = torch.randn(2, 64)
    ids, w = routing(2, 4, 2, seed=0)
    with pytest.raises(ValueError, match="expert ids"):
        fused_moe(p, x, ids + 10, w)
    with pytest.raises(ValueError, match="expert ids"):
        fused_moe(p, x, ids - 5, w)
    with pytest.raises(ValueError, match="hidden states"):
        fused_moe(p, torch.randn(2, 65), ids, w)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        fused_moe(p, x.half(), ids, w)
    with pytest.raises(ValueError, match="unknown expert format"):
        Format.parse("fp4")
    for group in (0, 8, 40):
        with pytest.raises(ValueError, match="multiple of 16"):
            pack_matrix(torch.randn(16, 64), "int4", group=group)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_matrix(torch.randn(16, 64), "fp8", block=(16, 8))


def test_fp8_layers_without_pair_flags_are_refused():
    p = pack_experts(*experts(2, 64, 40, seed=0), "fp8", block=(16, 16))
    fields = dict(fmt=p.fmt, hidden=p.hidden, inter=p.inter, kp13=p.kp13, kp2=p.kp2, w13_data=p.w13_data,
                  w2_data=p.w2_data, w13_scales=p.w13_scales, w2_scales=p.w2_scales, w13_flags=p.w13_flags,
                  w2_flags=p.w2_flags, block_k=p.block_k)
    type(p)(**fields)
    for bad in (dict(w13_flags=None), dict(w2_flags=p.w2_flags[:, :, :0].contiguous()),
                dict(w2_flags=p.w2_flags.view(torch.int8))):
        with pytest.raises(ValueError, match="line pair flags"):
            type(p)(**{**fields, **bad})


def test_inconsistent_packed_layers_are_refused():
    # A packed file whose header disagrees with its tensors must not reach the kernels (they would read or
    # write past the buffers sized from it).
    p = pack_experts(*experts(2, 64, 40, seed=0), "int4", group=32)
    fields = dict(fmt=p.fmt, hidden=p.hidden, inter=p.inter, kp13=p.kp13, kp2=p.kp2, w13_data=p.w13_data,
                  w2_data=p.w2_data, w13_scales=p.w13_scales, w2_scales=p.w2_scales, block_k=p.block_k,
                  group=p.group)
    type(p)(**fields)
    for bad, match in [(dict(group=64), "expected K"), (dict(group=8), "multiple of 16"),
                       (dict(kp2=p.kp2 + 32), "expected K"), (dict(inter=70), "expected K|tiles"),
                       (dict(w2_data=p.w2_data[:, :, :-64].contiguous()), "expected K")]:
        with pytest.raises(ValueError, match=match):
            type(p)(**{**fields, **bad})


@pytest.mark.parametrize("flags,path", [
    ({"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512vl", "avx512dq"}, "avx512"),  # Skylake-SP
    ({"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"},
     "avx512_vnni"),  # Cascade Lake
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni", "gfni"},
     "avx512_vnni"),  # Ice Lake: no BF16
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni", "gfni",
      "avx512_bf16"}, "avx512_bf16"),  # Zen 4
    ({"avx2", "fma", "avx512f", "avx512cd"}, "avx2"),  # Knights Landing: no BW
    ({"avx2", "fma"}, "avx2"),
    ({"sse4_2"}, "generic"),
], ids=["skylake-sp", "cascade-lake", "ice-lake", "zen4", "knl", "zen3", "old"])
def test_best_path_for_known_cpus(flags, path):
    assert best_path(frozenset(flags)) == path


def test_python_and_cpp_choose_the_same_path():
    cpp = _C.isa_name(_C.best_isa())
    # Linux may refuse the AMX tile state, which /proc/cpuinfo cannot tell
    assert cpp == best_path() or (cpp, best_path()) == ("avx512_bf16", "amx")


def test_module_entry_point_reports_features():
    r = subprocess.run([sys.executable, "-m", "cpu_kernels"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"kernel path: {_C.isa_name(_C.best_isa())}" in r.stdout
    r = subprocess.run([sys.executable, "-m", "cpu_kernels"], capture_output=True, text=True, timeout=60,
                       env={"HYBRIDD_KERNEL_ISA": "generic", "PATH": ""})
    assert r.returncode == 0 and "kernel path: generic" in r.stdout



def one_expert_per_token(t: int, e: int, rows: list[int]):
    """Routing giving expert i exactly rows[i] tokens (k = 1), so the AMX row blocks are known."""
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(rows)])[:t, None]
    return ids.long(), torch.rand(t, 1, generator=torch.Generator().manual_seed(t))


@pytest.mark.amx
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("h,i", [(130, 50), (256, 96), (64, 40)], ids=lambda v: str(v))
def test_amx_blocks_match_reference_and_avx512(fmt, h, i):
    # 3 rows stay on AVX-512 (7 too for int8, and 8 for int4); 7, 8, 16, 17, 31, 33 and 40 are one to three AMX
    # row blocks, most with a partial one; intermediate sizes give 1, 2 and 4 tiles per call (50 -> 4 tiles of
    # 16, 40 -> 3, 96 -> 6).
    rows = [3, 7, 8, 16, 17, 31, 33, 40]
    t = sum(rows)
    p = pack_experts(*experts(len(rows), h, i, seed=h + i), fmt)
    w13, w2 = unpack_experts(p)
    ids, weights = one_expert_per_token(t, len(rows), rows)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(i))
    for dtype in (torch.float32, torch.bfloat16):
        before = _C.amx_calls()
        out = fused_moe(p, x.to(dtype), ids, weights, isa=ISA_AMX)
        assert _C.amx_calls() > before, "the AMX kernels did not run"
        ref = fused_moe_reference(w13, w2, x.to(dtype).float(), ids, weights)
        assert rel_err(out, ref) < BOUND.get((fmt, dtype), INT_BOUND), dtype
        avx = fused_moe(p, x.to(dtype), ids, weights, isa=ISA_AVX512_BF16)
        if fmt == "int8":  # exact integer sums, the same dequantization arithmetic
            assert torch.equal(out, avx)
        elif fmt == "int4":  # exact group sums; the group and token scales are applied in another order
            assert rel_err(out, avx) < 1e-4
        else:
            assert rel_err(out, avx) < (2e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("group", [16, 32, 48, 64, 256])
def test_int4_groups_other_than_the_default(group):
    # 16 and 48 are not multiples of 32: AVX-512 only even for tall blocks; 32 runs half-width AMX k steps,
    # 64 and 256 full ones. 130 columns pad to a whole number of groups.
    rows = [1, 3, 33, 40]
    t = sum(rows)
    p = pack_experts(*experts(len(rows), 130, 50, seed=group), "int4", group=group)
    assert p.group == group and p.kp13 % group == 0 and p.kp2 % group == 0
    w13, w2 = unpack_experts(p)
    ids, weights = one_expert_per_token(t, len(rows), rows)
    x = torch.randn(t, 130, generator=torch.Generator().manual_seed(group))
    ref = fused_moe_reference(w13, w2, x, ids, weights)
    for isa in ISAS:
        before = _C.amx_calls()
        out = fused_moe(p, x, ids, weights, isa=isa)
        assert (_C.amx_calls() > before) == (isa == ISA_AMX and group % 32 == 0), isa
        assert rel_err(out, ref) < INT_BOUND, isa
    lin = PackedLinear.pack(w2[0][:37], "int4", group=group)
    xs = torch.randn(40, lin.in_features)
    for isa in ISAS:
        assert rel_err(linear(lin, xs, isa=isa), linear_reference(lin, xs)) < INT_BOUND, isa


def test_int4_default_group_error_stays_near_groups_of_32():
    # The default group of 128 trades accuracy for bandwidth: its round trip error on Gaussian weights stays
    # within 1.3x that of groups of 32 (measured 1.2x).
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    e128 = rel_err(unpack_matrix(pack_matrix(w, "int4")), w)
    e32 = rel_err(unpack_matrix(pack_matrix(w, "int4", group=32)), w)
    assert e32 < e128 < 1.3 * e32


def test_numa_override_gives_one_sub_pool_per_node(monkeypatch):
    from cpu_kernels.thread_pool import ALLOWED_CPUS, numa_nodes, pool_layout

    if len(ALLOWED_CPUS) < 2:
        pytest.skip("needs two usable cores")
    first, last = ALLOWED_CPUS[0], ALLOWED_CPUS[-1]
    monkeypatch.setenv("HYBRIDD_NUMA_NODES", f"{first};{last}")
    assert numa_nodes() == [[first], [last]]
    assert pool_layout(3) == ([first, last, first], [0, 1, 0])
    assert pool_layout(1) == ([first], [0])
    monkeypatch.setenv("HYBRIDD_NUMA_NODES", "4096")
    with pytest.raises(ValueError, match="HYBRIDD_NUMA_NODES"):
        numa_nodes()


def test_pool_spin_is_set_for_every_pool_and_sleeping_workers_wake():
    from cpu_kernels.moe import runner, set_pool_spin
    from cpu_kernels.thread_pool import POOL_SPIN_US, pool_layout

    assert runner() is runner(len(pool_layout()[0]))  # one pool for the default and its thread count
    p = pack_experts(*experts(6, 200, 150, seed=4), "bf16")
    ids, weights = routing(9, 6, 3, seed=4)
    x = torch.randn(9, 200).to(torch.bfloat16)
    want = fused_moe(p, x, ids, weights)
    try:
        set_pool_spin(0)
        assert runner().spin_us == 0 and runner(1).spin_us == 0
        for _ in range(20):  # workers sleep at once: every call wakes them through the futex
            time.sleep(0.001)
            assert torch.equal(fused_moe(p, x, ids, weights), want)
        with pytest.raises(ValueError, match="spin"):
            set_pool_spin(-1)
    finally:
        set_pool_spin(POOL_SPIN_US)
    assert runner().spin_us == POOL_SPIN_US


def test_pool_runs_stay_exact_while_a_worker_is_descheduled():
    """Another process busy on the workers' cores: run() no longer waits for a worker that has not woken, and a
    worker that wakes late must not take tasks of a run being set up. Many short runs back to back, with and
    without spinning workers, give the same bits."""
    from cpu_kernels.moe import runner, set_pool_spin
    from cpu_kernels.thread_pool import POOL_SPIN_US, pool_layout

    cpus = pool_layout()[0]
    if len(cpus) < 2:
        pytest.skip("needs a pool with a worker")
    runner()  # the pool exists before the busy process takes the workers' cores
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {set(cpus[1:])})\n"
                             "while True: pass"])
    p = pack_experts(*experts(6, 200, 150, seed=5), "bf16")
    ids, weights = routing(3, 6, 2, seed=5)
    x = torch.randn(3, 200).to(torch.bfloat16)
    want = fused_moe(p, x, ids, weights)
    try:
        for spin in (0, 50, POOL_SPIN_US):
            set_pool_spin(spin)
            for _ in range(300):
                assert torch.equal(fused_moe(p, x, ids, weights), want)
    finally:
        set_pool_spin(POOL_SPIN_US)
        busy.kill()
        busy.wait()


# A fresh process: a small kernel call first (it pins the thread), then torch's first parallel op.
TORCH_TEAM_AFTER_A_KERNEL_CALL = """
import os, torch
torch.set_num_threads(2)
from cpu_kernels.moe import fused_moe, pack_experts
w = [torch.randn(32, 64) for _ in range(2)]
fused_moe(pack_experts(w, w, [torch.randn(64, 32)] * 2, "bf16"), torch.randn(1, 64), torch.tensor([[1]]),
          torch.ones(1, 1))
torch.zeros(1 << 20).add_(1)
print([len(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")])
"""


def test_torch_threads_started_after_a_kernel_call_get_every_core():
    """The pool keeps its calling thread on one core; torch's worker threads, started by that thread at its
    first large op, would inherit that one core and crawl (index_add_ 60 ms instead of 0.1)."""
    from cpu_kernels.thread_pool import ALLOWED_CPUS, unpin_child

    if len(ALLOWED_CPUS) < 2:
        pytest.skip("this process may use one core only")
    r = subprocess.run([sys.executable, "-c", TORCH_TEAM_AFTER_A_KERNEL_CALL], capture_output=True, text=True,
                       timeout=60, preexec_fn=unpin_child)
    assert r.returncode == 0, r.stderr
    widths = eval(r.stdout)
    # one-core masks: the calling thread and one pool worker per other core, no torch thread
    assert widths.count(1) == len(ALLOWED_CPUS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_numa_sub_pools_compute_the_same_bits(fmt):
    # Each node takes one slice of every expert's output rows; every tile is computed the same way whichever
    # thread runs it, so one, two or three sub-pools give identical results (phases A and B, and a linear).
    from cpu_kernels.thread_pool import ALLOWED_CPUS

    cpus = [ALLOWED_CPUS[i % len(ALLOWED_CPUS)] for i in range(3)]
    pools = [_C.MoeRunner(cpus[:2], [0, 0], 50), _C.MoeRunner(cpus[:2], [0, 1], 50), _C.MoeRunner(cpus, [0, 1, 2], 50)]
    assert [r.num_nodes for r in pools] == [1, 2, 3]
    p = pack_experts(*experts(6, 200, 150, seed=9), fmt)
    ids, weights = routing(70, 6, 3, seed=9)
    x = torch.randn(70, 200).to(torch.bfloat16)
    ids32, w32 = ids.to(torch.int32).contiguous(), weights.contiguous()
    lin = PackedLinear.pack(torch.randn(90, 200), fmt)
    outs = []
    for r in pools:
        out, y = torch.empty_like(x), torch.empty(70, 90, dtype=torch.bfloat16)
        r.forward(p.layer, x.data_ptr(), False, 70, 3, ids32.data_ptr(), w32.data_ptr(), 1.0, out.data_ptr(),
                  ISAS[-1])
        m = lin.matrix
        r.linear(int(m.fmt), lin.handle, m.n, m.k, m.block[1], m.group, x.data_ptr(), False, 70, y.data_ptr(),
                 ISAS[-1])
        outs.append((out, y))
    for out, y in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(y, outs[0][1])
