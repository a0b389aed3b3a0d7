"""Split-KV (flash-decoding) attention for one query token per sequence over a paged cache.

Stage 1: one program per (sequence, KV head, split) runs an online softmax over its share of the
context for all query heads of that KV head at once (the group is the M side of the dot), writing a
partial output and its log-sum-exp. Stage 2 combines the splits; with one split (short contexts), stage 1 writes
the result and stage 2 does not run. GQA and MLA share the kernel: MLA's
absorbed decode is one latent KV head whose keys are the cached [latent | rope] rows and whose values
are the latent part of the same rows, with every query head in the group.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu.paged_reference import paged_attention

MIN_DOT = 16
TARGET_SPLITS = 8


@triton.jit
def attend_tile(q, m, denom, acc, toks, tmask, visible, table_row, k_ptr, v_ptr, kvh,
                s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, scale, DK: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of an online softmax: the sequence's tokens `toks` (valid where tmask), found through its
    block-table row; `visible` [rows, tile] masks what each query row may see. Returns (m, denom, acc)."""
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    blk = tl.load(table_row + toks // PAGE, mask=tmask, other=0).to(tl.int64)
    off = toks % PAGE
    k = tl.load(k_ptr + blk[:, None] * s_kb + off[:, None] * s_kt + kvh * s_kh + dk[None, :],
                mask=tmask[:, None] & (dk[None, :] < DK), other=0.0)
    if UPCAST:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    else:
        qk = tl.dot(q, tl.trans(k)) * scale
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    p = tl.exp(qk - m_new[:, None])
    alpha = tl.exp(m - m_new)
    denom = denom * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + blk[:, None] * s_vb + off[:, None] * s_vt + kvh * s_vh + dv[None, :],
                mask=tmask[:, None] & (dv[None, :] < DV), other=0.0)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, tables, ctx_lens, o_part, lse_part,
                  s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_tb, s_ob, s_oh, s_os, s_lb, s_lh,
                  scale, num_splits,
                  GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                  UPCAST: tl.constexpr, FINAL: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_lens + b)
    # Each sequence divides its own context into num_splits parts of whole key tiles, so the grid never
    # depends on the batch's longest context (the host does not read the lengths; CUDA graphs replay it).
    split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    hs = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + hs
    hmask = hs < GROUP
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + dk[None, :],
                mask=hmask[:, None] & (dk[None, :] < DK), other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tmask = toks < end
        m, denom, acc = attend_tile(q, m, denom, acc, toks, tmask, tmask[None, :], tables + b * s_tb, k_ptr, v_ptr,
                                    kvh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, scale, DK, DV, PAGE, BLOCK_DK, BLOCK_DV,
                                    UPCAST)
    safe = tl.where(denom > 0, denom, 1.0)
    out = acc / safe[:, None]
    lse = tl.where(denom > 0, m + tl.log(safe), float("-inf"))
    o_ptrs = o_part + b * s_ob + heads[:, None] * s_oh + split * s_os + dv[None, :]
    o_mask = hmask[:, None] & (dv[None, :] < DV)
    if FINAL:  # one split, whose normalized output is the result: what the combine would write, bit for bit
        tl.store(o_ptrs, out.to(o_part.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs, out, mask=o_mask)
        tl.store(lse_part + b * s_lb + heads * s_lh + split, lse, mask=hmask)


@triton.jit
def _combine_kernel(o_part, lse_part, out, num_splits, s_ob, s_oh, s_os, s_lb, s_lh, s_b, s_h,
                    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    smask = ss < num_splits
    lse = tl.load(lse_part + b * s_lb + h * s_lh + ss, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp(lse - top), 0.0)
    w = w / tl.sum(w, 0)
    parts = tl.load(o_part + b * s_ob + h * s_oh + ss[:, None] * s_os + dv[None, :],
                    mask=smask[:, None] & (dv[None, :] < DV), other=0.0)
    result = tl.sum(parts * w[:, None], 0)
    tl.store(out + b * s_b + h * s_h + dv, result.to(out.dtype.element_ty), mask=dv < DV)


def upcast_dots(dtype: torch.dtype) -> bool:
    """fp32 operands run their dots in IEEE fp32; so do 16-bit ones under Triton's interpreter, whose
    bf16 tl.dot returns garbage (triton 3.7). On a GPU 16-bit dots stay on the tensor cores."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def dot_width(n: int) -> int:
    """A power-of-two tile side of at least 16, the smallest tl.dot operand GPUs accept."""
    return max(MIN_DOT, triton.next_power_of_2(n))


def paged_shapes(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(page size, KV heads, value width) after checking q [*, Hq, Dk] against caches [blocks, page, Hkv, D]."""
    page, hkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    if q.shape[1] % hkv or k_cache.shape[3] != q.shape[2] or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"{op}: q {tuple(q.shape)} vs caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} "
                         "(Hq a multiple of Hkv, equal key widths and a unit last stride needed)")
    return page, hkv, dv


def split_count(max_context: int, block_n: int = 32) -> int:
    """Splits per sequence for contexts up to max_context: enough to spread short batches over the GPU, each
    split at least four key tiles long."""
    return max(1, min(TARGET_SPLITS, triton.cdiv(max_context, 4 * block_n)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                     block_n: int = 32) -> torch.Tensor:
    """q [B, Hq, Dk]; caches [blocks, page, Hkv, D] (any strides but a unit last one; v may be a view of
    k's storage); block_tables [B, max_blocks] int32; context_lens [B] int32 >= 1. Returns [B, Hq, Dv].

    Without num_splits the split count follows the longest context (one device-to-host read); with it
    nothing is read back, so the call can be captured in a CUDA graph."""
    batch, hq, dk = q.shape
    page, hkv, dv = paged_shapes("decode_attention", q, k_cache, v_cache)
    q = q.contiguous()
    group = hq // hkv
    splits = num_splits or split_count(int(context_lens.max()), block_n)
    out = torch.empty(batch, hq, dv, dtype=q.dtype, device=q.device)
    final = splits == 1  # the split kernel writes the result: no partials, no combine
    o_part = out.unsqueeze(2) if final else torch.empty(batch, hq, splits, dv, dtype=torch.float32, device=q.device)
    # With FINAL the kernel stores no log-sum-exp: `out` only fills the argument and its strides.
    lse = out if final else torch.empty(batch, hq, splits, dtype=torch.float32, device=q.device)
    _split_kernel[(batch, hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, o_part, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        scale, splits, GROUP=group, DK=dk, DV=dv, PAGE=page, BLOCK_H=dot_width(group),
        BLOCK_DK=dot_width(dk), BLOCK_DV=dot_width(dv), BLOCK_N=block_n, UPCAST=upcast_dots(q.dtype), FINAL=final)
    if final:
        return out
    _combine_kernel[(batch, hq)](o_part, lse, out, splits, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                                 lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), DV=dv,
                                 BLOCK_S=triton.next_power_of_2(splits), BLOCK_DV=triton.next_power_of_2(dv))
    return out


def table_list(block_tables: torch.Tensor, context_lens: list[int], page: int) -> list[torch.Tensor]:
    """The padded [B, max_blocks] tables as the torch reference takes them: one trimmed row per sequence."""
    return [block_tables[i, :triton.cdiv(c, page)].long() for i, c in enumerate(context_lens)]


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    lens = [int(c) for c in context_lens]
    tables = table_list(block_tables, lens, k_cache.shape[1])
    return paged_attention(q, k_cache, v_cache, list(range(len(lens))), [1] * len(lens), lens, tables, scale)
