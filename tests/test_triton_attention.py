"""Triton attention kernels vs their torch references: paged layouts with shuffled blocks, odd lengths,
mixed batches, GQA and MLA. Runs on the GPU where there is one, else under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from gpu.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from gpu.extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from gpu.kv_store import store_kv, store_kv_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# bf16 results also agree as a whole: rounding alone leaves ~5e-3, while one token of context too many or too few
# moves the result by a few per cent.
BF16_REL_L2 = 1e-2


def paged(context_lens: list[int], page: int, seed: int) -> tuple[torch.Tensor, int]:
    """Block tables [B, max_blocks] int32 over a shuffled pool (blocks of a sequence are not adjacent)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(c / page) for c in context_lens]
    pool = torch.randperm(sum(need) + 3, generator=g)
    tables = torch.zeros(len(need), max(need), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = pool[used:used + n]
        used += n
    return tables.to(DEVICE), sum(need) + 3


def gqa_cache(blocks: int, page: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(blocks, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    return k, v


def mla_cache(blocks: int, page: int, lora: int, rope: int, dtype: torch.dtype, seed: int):
    """One latent head: keys are [latent | rope] rows, values the latent part of the same storage."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(blocks, page, lora + rope, generator=g).to(dtype).to(DEVICE)
    return cache.unsqueeze(2), cache[..., :lora].unsqueeze(2)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    a, b = a.float(), b.float()
    torch.testing.assert_close(a, b, atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.bfloat16:
        assert ((a - b).norm() / b.norm()).item() < BF16_REL_L2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(15,), (3, 5), (1, 576)])
def test_store_kv(dtype, shape):
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(6, 4, *shape, generator=g).to(dtype).to(DEVICE)
    want = cache.clone()
    slots = torch.randperm(24, generator=g)[:9].to(DEVICE)
    values = torch.randn(9, *shape, generator=g).to(dtype).to(DEVICE)
    store_kv(cache, slots, values)
    store_kv_reference(want, slots, values)
    assert torch.equal(cache, want)


DECODE_CASES = [
    # (hq, hkv, d, page, context lens)
    (4, 2, 16, 16, [1, 7, 33, 100]),
    (8, 1, 24, 4, [5, 61]),
    (3, 3, 8, 16, [17]),
    (6, 2, 40, 8, [129, 2, 64]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"h{c[0]}-kv{c[1]}-d{c[2]}-p{c[3]}" for c in DECODE_CASES])
@pytest.mark.parametrize("splits", [None, 1, 3, 8])
def test_gqa_decode(case, dtype, splits):
    hq, hkv, d, page, lens = case
    tables, blocks = paged(lens, page, seed=len(lens))
    k, v = gqa_cache(blocks, page, hkv, d, dtype, seed=2)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = d ** -0.5
    got = decode_attention(q, k, v, tables, ctx, scale, num_splits=splits, block_n=16)
    close(got, decode_attention_reference(q, k, v, tables, ctx, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,lora,rope,lens", [(4, 32, 8, [3, 50]), (16, 64, 16, [1, 23, 90]), (5, 24, 8, [40])])
def test_mla_decode_absorbed(dtype, heads, lora, rope, lens):
    page = 16
    tables, blocks = paged(lens, page, seed=5)
    k, v = mla_cache(blocks, page, lora, rope, dtype, seed=6)
    q = torch.randn(len(lens), heads, lora + rope, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = 0.11
    got = decode_attention(q, k, v, tables, ctx, scale, block_n=16)
    assert got.shape == (len(lens), heads, lora)
    close(got, decode_attention_reference(q, k, v, tables, ctx, scale), dtype)


EXTEND_CASES = [
    # (query lens, context lens): plain prefills, extends over a cached prefix, decode rows, all mixed
    ([5], [5]),
    ([3, 1, 17, 9], [20, 9, 40, 9]),
    ([33, 2], [33, 70]),
]


def flat_queries(qlens: list[int], heads: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    starts = [sum(qlens[:i]) for i in range(len(qlens))]
    q = torch.randn(sum(qlens), heads, d, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    return q, starts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qlens,lens", EXTEND_CASES, ids=["prefill", "mixed", "prefix"])
@pytest.mark.parametrize("hq,hkv,d,page", [(4, 2, 16, 16), (3, 1, 12, 4)])
def test_gqa_extend(dtype, qlens, lens, hq, hkv, d, page):
    tables, blocks = paged(lens, page, seed=9)
    k, v = gqa_cache(blocks, page, hkv, d, dtype, seed=10)
    q, starts = flat_queries(qlens, hq, d, dtype)
    scale = d ** -0.5
    got = extend_attention(q, k, v, tables, starts, qlens, lens, scale, block_m=16, block_n=16)
    close(got, extend_attention_reference(q, k, v, tables, starts, qlens, lens, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_extend(dtype):
    qlens, lens, heads, lora, rope = [4, 19, 1], [4, 30, 12], 4, 32, 8
    tables, blocks = paged(lens, 8, seed=11)
    k, v = mla_cache(blocks, 8, lora, rope, dtype, seed=12)
    q, starts = flat_queries(qlens, heads, lora + rope, dtype)
    got = extend_attention(q, k, v, tables, starts, qlens, lens, 0.2, block_n=16)
    close(got, extend_attention_reference(q, k, v, tables, starts, qlens, lens, 0.2), dtype)


def test_mismatched_shapes_are_rejected():
    k, v = gqa_cache(4, 16, 3, 16, torch.float32, seed=1)
    tables, _ = paged([5], 16, seed=1)
    ctx = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        decode_attention(torch.randn(1, 4, 16, device=DEVICE), k, v, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="key widths"):
        extend_attention(torch.randn(5, 3, 8, device=DEVICE), k, v, tables, [0], [5], [5], 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len,ctx", [(7, 7), (64, 64), (30, 130), (1, 65)])
def test_causal_over_expanded_keys(dtype, q_len, ctx):
    """The Triton backend's causal attention (MLA's expanded prompt rows: per-head K and V cut into pages, padded)
    against the backend interface's torch version."""
    from hybrid.layers.attention.backend import AttentionBackend
    from hybrid.layers.attention.triton_backend import TritonAttention

    g = torch.Generator().manual_seed(q_len * 1000 + ctx)
    heads, dk, dv = 3, 24, 16
    q = torch.randn(q_len, heads, dk, generator=g).to(dtype).to(DEVICE)
    kv = torch.randn(ctx, heads, dk + dv, generator=g).to(dtype).to(DEVICE)
    k, v = kv.split([dk, dv], dim=-1)  # v a strided view, as the model passes it
    got = TritonAttention().causal(q, k.contiguous(), v, dk ** -0.5)
    want = AttentionBackend.causal(TritonAttention(), q, k.contiguous(), v, dk ** -0.5)
    close(got, want, dtype)
