"""Paged attention kernel against its torch reference: decode and prefill / extend spans, GQA and MLA shapes,
odd sizes, scattered paged blocks, contexts split over many slices, every instruction-set path."""

from __future__ import annotations

import pytest
import torch
from conftest import ISAS

from cpu_kernels.attention import paged_attention, paged_attention_reference
from cpu_kernels.moe import ISA_AMX, ISA_AVX512_BF16

BOUND = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def paged(lens: list[int], block_size: int, seed: int) -> tuple[torch.Tensor, int]:
    """Block tables over a shuffled pool, so no sequence's blocks are contiguous or in order."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    pool = torch.randperm(sum(need) + 3, generator=g)
    width = max(need)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, k in enumerate(need):
        tables[i, :k] = pool[used:used + k]
        used += k
    return tables, sum(need) + 3


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 16), (32, 4, 128), (6, 6, 48), (4, 1, 8), (5, 5, 40), (12, 3, 24),
                                     (10, 5, 64), (12, 1, 96)], ids=lambda v: str(v))
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gqa_matches_reference(hq, hkv, d, block_size, dtype):
    lens = [1, 15, 16, 17, 300, 700]
    tables, blocks = paged(lens, block_size, seed=hq * d + block_size)
    g = torch.Generator().manual_seed(d)
    k = torch.randn(blocks, block_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(blocks, block_size, hkv, d, generator=g).to(dtype)
    q = (torch.randn(len(lens), hq, d, generator=g) * 2).to(dtype)
    ctx = torch.tensor(lens)
    ref = paged_attention_reference(q, k, v, tables, ctx, d ** -0.5)
    for isa in ISAS:
        out = paged_attention(q, k, v, tables, ctx, d ** -0.5, isa=isa)
        assert out.dtype == dtype and out.shape == (len(lens), hq, d)
        for i in range(len(lens)):
            assert rel_err(out[i], ref[i]) < BOUND[dtype], (isa, lens[i])


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 16), (32, 4, 128), (6, 3, 24), (40, 2, 32)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_prefill_and_extend_spans_are_causal(hq, hkv, d, dtype):
    # Whole prompts (query span = context), extends after a cached prefix, and decode rows in one call;
    # spans longer than a task's query tile (128 rows / group) and not multiples of the 16-key chunk.
    lens = [1, 37, 300, 64, 129, 9]
    qlens = [1, 37, 45, 1, 100, 9]
    tables, blocks = paged(lens, 16, seed=hq + d)
    g = torch.Generator().manual_seed(hq)
    k = torch.randn(blocks, 16, hkv, d, generator=g).to(dtype)
    v = torch.randn(blocks, 16, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(qlens), hq, d, generator=g).to(dtype)
    ctx, ql = torch.tensor(lens), torch.tensor(qlens)
    ref = paged_attention_reference(q, k, v, tables, ctx, d ** -0.5, ql)
    for isa in ISAS:
        out = paged_attention(q, k, v, tables, ctx, d ** -0.5, ql, isa=isa)
        assert out.shape == ref.shape
        row = 0
        for i, n in enumerate(qlens):
            assert rel_err(out[row:row + n], ref[row:row + n]) < BOUND[dtype], (isa, i)
            row += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mla_latent_reads_v_as_a_slice_of_the_cache(dtype):
    # DeepSeek-V3 latent attention: one KV head of lora + rope = 512 + 64 columns, V its first 512.
    lens = [3, 64, 257]
    tables, blocks = paged(lens, 16, seed=1)
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(blocks, 16, 576, generator=g).to(dtype)
    q = torch.randn(len(lens), 16, 576, generator=g).to(dtype)
    k, v = cache.unsqueeze(2), cache[..., :512].unsqueeze(2)
    ref = paged_attention_reference(q, k, v, tables, torch.tensor(lens), 0.07)
    for isa in ISAS:
        out = paged_attention(q, k, v, tables, torch.tensor(lens), 0.07, isa=isa)
        assert out.shape == (3, 16, 512)
        assert rel_err(out, ref) < BOUND[dtype], isa


def test_long_context_over_many_slices_and_extreme_scores():
    # A pool of 16 threads asks for 64 tasks: two sequences of one KV head split their contexts 32 ways
    # (20000 tokens: slices of 625; 2 tokens: one); scores span hundreds of units, so most weights underflow.
    lens = [20000, 2]
    tables, blocks = paged(lens, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    k = torch.randn(blocks, 16, 1, 16, generator=g)
    v = torch.randn(blocks, 16, 1, 16, generator=g)
    q = torch.randn(2, 4, 16, generator=g) * 30
    ref = paged_attention_reference(q, k, v, tables, torch.tensor(lens), 1.0)
    for isa in ISAS:
        for threads in (None, 16):
            out = paged_attention(q, k, v, tables, torch.tensor(lens), 1.0, num_threads=threads, isa=isa)
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) < 1e-4, (isa, threads)


def test_bad_inputs_are_rejected():
    tables, blocks = paged([20], 16, seed=0)
    k = torch.randn(blocks, 16, 2, 16)
    q = torch.randn(1, 4, 16)
    ctx = torch.tensor([20])
    with pytest.raises(ValueError, match="context lengths"):
        paged_attention(q, k, k, tables, torch.tensor([33]), 1.0)
    with pytest.raises(ValueError, match="context lengths"):
        paged_attention(q, k, k, tables, torch.tensor([0]), 1.0)
    with pytest.raises(ValueError, match="block tables"):
        paged_attention(q, k, k, tables + blocks, ctx, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        paged_attention(torch.randn(1, 3, 16), k, k, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="cache must be"):
        paged_attention(q, k.bfloat16(), k, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), k, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="add up"):
        paged_attention(q, k, k, tables, ctx, 1.0, torch.tensor([2]))
    with pytest.raises(ValueError, match="query tokens"):
        paged_attention(torch.randn(21, 4, 16), k, k, tables, ctx, 1.0, torch.tensor([21]))
    with pytest.raises(ValueError, match="add up"):
        paged_attention(q[:0], k, k, tables, ctx, 1.0)
    assert paged_attention(q[:0], k, k, tables[:0], ctx[:0], 1.0).shape == (0, 4, 16)
    # Only the entries a context reaches are read and checked: padding past them may hold anything.
    padded = torch.cat([tables, torch.full((1, 3), -1, dtype=tables.dtype)], dim=1)
    assert torch.equal(paged_attention(q, k, k, padded, ctx, 1.0), paged_attention(q, k, k, tables, ctx, 1.0))
    short = tables.clone()
    short[0, -1] = blocks  # context 16 stays in the first block; 17 reaches the second
    paged_attention(q, k, k, short, torch.tensor([16]), 1.0)
    with pytest.raises(ValueError, match="block tables"):
        paged_attention(q, k, k, short, torch.tensor([17]), 1.0)


def test_bf16_pairs_over_many_slices_and_extreme_scores():
    """The bf16 kernel of the avx512_bf16 / amx paths (head dims a multiple of 32): long contexts over many slices,
    a chunk's tail of odd length, and scores so spread that most bf16-rounded weights are zero."""
    if not {ISA_AVX512_BF16, ISA_AMX} & set(ISAS):
        pytest.skip("this CPU has neither avx512_bf16 nor amx: the kernel under test cannot run here")
    lens = [5001, 3, 18]
    tables, blocks = paged(lens, 16, seed=5)
    g = torch.Generator().manual_seed(6)
    k = torch.randn(blocks, 16, 2, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(blocks, 16, 2, 64, generator=g).to(torch.bfloat16)
    q = (torch.randn(3, 6, 64, generator=g) * 8).to(torch.bfloat16)
    ref = paged_attention_reference(q, k, v, tables, torch.tensor(lens), 0.5)
    for isa in ISAS:
        for threads in (None, 16):
            out = paged_attention(q, k, v, tables, torch.tensor(lens), 0.5, num_threads=threads, isa=isa)
            assert torch.isfinite(out.float()).all()
            assert rel_err(out, ref) < BOUND[torch.bfloat16], (isa, threads)
