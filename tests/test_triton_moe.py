"""The streamed-prefill fused MoE (gpu/fused_moe.py) against its torch reference over the dequantized pack: every
packed format, fp32 and bf16 activations, odd shapes, experts with no tokens, experts absent from the device, ids
of -1, and every fp8 code. Runs on the GPU where there is one, else under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cpu_kernels.moe import PackedExperts, pack_experts, unpack_experts  # noqa: E402
from gpu.fused_moe import DeviceExperts, fused_moe, group_by_expert, tile_shape  # noqa: E402
from gpu.moe_reference import fused_moe_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
BF16_REL_L2 = 1e-2  # bf16 results also agree as a whole (rounding leaves 4-7e-3 here); a wrong row moves it more
FORMATS = ["bf16", "fp8", "int8", "int4"]


def on_device(p: PackedExperts, slot: torch.Tensor | None = None) -> DeviceExperts:
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    slot = torch.arange(p.num_experts, dtype=torch.int32) if slot is None else slot
    return DeviceExperts(int(p.fmt), p.hidden, p.inter, p.kp13, p.kp2, move(p.w13_data), move(p.w2_data),
                         move(p.w13_scales), move(p.w2_scales), slot.to(DEVICE), p.block_k, p.group)


def random_layer(experts: int, hidden: int, inter: int, fmt: str, seed: int, **kw) -> PackedExperts:
    g = torch.Generator().manual_seed(seed)
    mats = lambda n, k: [torch.randn(n, k, generator=g) * 0.1 for _ in range(experts)]  # noqa: E731
    return pack_experts(mats(inter, hidden), mats(inter, hidden), mats(hidden, inter), fmt, **kw)


def check(p: PackedExperts, tokens: int, topk: int, dtype: torch.dtype, seed: int, ids: torch.Tensor | None = None,
          slot: torch.Tensor | None = None, tile: tuple[int, int] | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, p.hidden, generator=g).to(dtype)
    if ids is None:
        ids = torch.randint(0, p.num_experts, (tokens, topk), generator=g)
    weights = torch.rand(tokens, ids.shape[1], generator=g)
    w13, w2 = unpack_experts(p)
    present = None if slot is None else slot >= 0
    want = fused_moe_reference(x, ids, weights, w13, w2, present)
    block_m, block_n = tile or (None, None)
    got = fused_moe(on_device(p, slot), x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), block_m, block_n).cpu()
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.bfloat16:
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < BF16_REL_L2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,hidden,inter,tokens,topk", [(4, 64, 32, 9, 2), (5, 72, 40, 13, 3),
                                                             (3, 200, 24, 1, 1), (6, 48, 80, 33, 4),
                                                             (3, 33, 17, 5, 2), (4, 130, 70, 7, 3)])
def test_matches_reference(fmt, dtype, experts, hidden, inter, tokens, topk):
    kw = {"group": 16} if fmt == "int4" and hidden % 32 else {}
    if fmt == "fp8":
        kw["block"] = (32, 64)
    check(random_layer(experts, hidden, inter, fmt, seed=hidden + inter, **kw), tokens, topk, dtype, seed=tokens)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tile", [(32, 64), (64, 64), (64, 128), (128, 64)])
def test_tall_and_wide_tiles(fmt, tile):
    """The tiles long prefills use: blocks of an expert's pairs partly filled, a last partial block, and features
    past the end of a 64- or 128-wide block."""
    kw = {"block": (32, 64)} if fmt == "fp8" else {}
    check(random_layer(3, 96, 80, fmt, seed=7, **kw), 45, 3, torch.float32, seed=11, tile=tile)


def test_tile_shape_follows_pairs_per_expert():
    assert tile_shape(8192 * 8, 256) == (128, 64)  # DeepSeek-V3, an 8K pass: 256 pairs per expert
    assert tile_shape(2048 * 8, 256) == (64, 64)
    assert tile_shape(1024 * 8, 256) == (32, 64)
    assert tile_shape(64 * 8, 256) == (16, 32)
    assert tile_shape(5, 0) == (16, 32)
    x = torch.zeros(2, 64, device=DEVICE)
    ids = torch.zeros(2, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="powers of two from 16"):
        fused_moe(on_device(random_layer(1, 64, 32, "bf16", seed=0)), x, ids, torch.ones(2, 1, device=DEVICE), 24)


@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_without_tokens_and_negative_ids(fmt):
    p = random_layer(8, 64, 32, fmt, seed=3)
    ids = torch.tensor([[5, -1], [5, 2], [-1, -1], [2, 5], [7, 5]])
    check(p, 5, 2, torch.float32, seed=4, ids=ids)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_only_present_experts_count(fmt):
    """SmallEP / a subset on the device: experts whose slot is -1 are computed elsewhere and add nothing here."""
    p = random_layer(6, 64, 48, fmt, seed=5)
    keep = torch.tensor([0, 2, 3])
    sub = PackedExperts(p.fmt, p.hidden, p.inter, p.kp13, p.kp2, p.w13_data[keep].contiguous(),
                        p.w2_data[keep].contiguous(), *(None if t is None else t[keep].contiguous() for t in (
                            p.w13_scales, p.w2_scales, p.w13_comp, p.w2_comp, p.w13_flags, p.w2_flags)),
                        p.block_k, p.group)
    slot = torch.full((6,), -1, dtype=torch.int32)
    slot[keep] = torch.arange(3, dtype=torch.int32)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(11, 64, generator=g)
    ids = torch.randint(0, 6, (11, 3), generator=g)
    weights = torch.rand(11, 3, generator=g)
    w13, w2 = unpack_experts(p)
    want = fused_moe_reference(x, ids, weights, w13, w2, slot >= 0)
    got = fused_moe(on_device(sub, slot), x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def fp8_codes(rows: int, cols: int, offset: int) -> torch.Tensor:
    codes = (torch.arange(rows * cols) * 7 + offset) % 256
    return codes.to(torch.uint8).view(torch.float8_e4m3fn).view(rows, cols)


def test_every_fp8_code():
    """Weights holding each of the 256 e4m3 codes (NaN codes elsewhere): finite ones decode exactly; a NaN code
    makes the rows that read it NaN, as in the reference."""
    hidden, inter = 256, 32
    nan_free = lambda w: torch.where(torch.isnan(w.float()), torch.zeros_like(w.float()), w.float()).to(  # noqa: E731
        torch.float8_e4m3fn)
    gate = [nan_free(fp8_codes(inter, hidden, e)) for e in range(2)]
    up = [nan_free(fp8_codes(inter, hidden, 3 + e)) for e in range(2)]
    down = [nan_free(fp8_codes(hidden, inter, 5 + e)) for e in range(2)]
    seen = torch.cat([w.view(torch.uint8).flatten() for w in gate + up + down]).unique()
    assert seen.numel() == 254  # all but the two NaN codes (0x7f, 0xff)
    scale = lambda n, k: [torch.full((-(-n // 128), -(-k // 128)), 2.0 ** -12) for _ in range(2)]  # noqa: E731
    p = pack_experts(gate, up, down, "fp8", gate_scale=scale(inter, hidden), up_scale=scale(inter, hidden),
                     down_scale=scale(hidden, inter))
    check(p, 7, 2, torch.float32, seed=8)
    gate[1].view(torch.uint8)[3, 10] = 0x7F
    p = pack_experts(gate, up, down, "fp8", gate_scale=scale(inter, hidden), up_scale=scale(inter, hidden),
                     down_scale=scale(hidden, inter))
    ids = torch.tensor([[0, 1], [0, 0], [1, 0]])
    x = torch.randn(3, hidden)
    got = fused_moe(on_device(p), x.to(DEVICE), ids.to(DEVICE), torch.ones(3, 2, device=DEVICE)).cpu()
    assert torch.isnan(got[0]).all() and torch.isnan(got[2]).all() and not torch.isnan(got[1]).any()


def test_grouping_pads_each_expert_to_blocks():
    ids = torch.tensor([[2, 0], [2, 2], [0, -1]])
    slot = torch.tensor([0, -1, 1], dtype=torch.int32)
    rows, owner = group_by_expert(ids, slot, 4)
    assert owner.tolist() == [0, 2, -1, -1, -1]  # blocks: ceil(6 / 4) + 3 experts = 5, two used
    assert rows[:4].tolist() == [1, 4, -1, -1] and rows[4:8].tolist() == [0, 2, 3, -1] and (rows[8:] == -1).all()
