"""Prefill/extend attention over a paged cache: each sequence's new query rows attend to its cached prefix
(a full rectangle) and to the new tokens up to their own position (the causal triangle), any mix of
query and context lengths in one launch. The new tokens' K/V must already be stored in the cache.

One program per (tile of BLOCK_M query rows of one sequence, query head); key tiles stop at the last
position the tile's rows can see. GQA reads KV head h // group; MLA passes one latent head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.decode_attention import attend_tile, dot_width, paged_shapes, table_list, upcast_dots
from gpu.paged_reference import paged_attention


@triton.jit
def _extend_kernel(q_ptr, k_ptr, v_ptr, tables, tile_seq, tile_row, q_starts, q_lens, ctx_lens, out_ptr,
                   s_qn, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_tb, s_on, s_oh, scale,
                   GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                   UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(tile_seq + tile)
    row0 = tl.load(tile_row + tile)
    q_start = tl.load(q_starts + seq)
    q_len = tl.load(q_lens + seq)
    ctx = tl.load(ctx_lens + seq)
    kvh = h // GROUP
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    pos = ctx - q_len + rows
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + (q_start + rows)[:, None].to(tl.int64) * s_qn + h * s_qh + dk[None, :],
                mask=rmask[:, None] & (dk[None, :] < DK), other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = ctx - q_len + tl.minimum(row0 + BLOCK_M, q_len)
    for n0 in range(0, hi, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tmask = toks < hi
        visible = tmask[None, :] & (toks[None, :] <= pos[:, None])
        m, denom, acc = attend_tile(q, m, denom, acc, toks, tmask, visible, tables + seq * s_tb, k_ptr, v_ptr, kvh,
                                    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, scale, DK, DV, PAGE, BLOCK_DK, BLOCK_DV,
                                    UPCAST)
    out = acc / denom[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None].to(tl.int64) * s_on + h * s_oh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     query_starts: list[int], query_lens: list[int], context_lens: list[int], scale: float,
                     block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """q [N, Hq, Dk] (sequence i's rows at query_starts[i]:+query_lens[i], at positions ending at
    context_lens[i] - 1); caches [blocks, page, Hkv, D]; block_tables [num seqs, max_blocks] int32.
    Returns [N, Hq, Dv]."""
    n, hq, dk = q.shape
    page, hkv, dv = paged_shapes("extend_attention", q, k_cache, v_cache)
    q = q.contiguous()
    seqs, rows = [], []
    for i, qlen in enumerate(query_lens):
        for r in range(0, qlen, block_m):
            seqs.append(i)
            rows.append(r)
    dev = q.device
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    out = torch.empty(n, hq, dv, dtype=q.dtype, device=dev)
    if not seqs:
        return out
    _extend_kernel[(len(seqs), hq)](
        q, k_cache, v_cache, block_tables, as_i32(seqs), as_i32(rows), as_i32(query_starts), as_i32(query_lens),
        as_i32(context_lens), out, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        scale, GROUP=hq // hkv, DK=dk, DV=dv, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DK=dot_width(dk),
        BLOCK_DV=dot_width(dv), UPCAST=upcast_dots(q.dtype))
    return out


def extend_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, query_starts: list[int], query_lens: list[int],
                               context_lens: list[int], scale: float) -> torch.Tensor:
    tables = table_list(block_tables, context_lens, k_cache.shape[1])
    return paged_attention(q, k_cache, v_cache, query_starts, query_lens, context_lens, tables, scale)
