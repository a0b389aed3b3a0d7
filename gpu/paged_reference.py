"""Paged KV cache and attention over it, in pure torch: the CPU path and the reference for the Triton kernels.

A cache is [num_blocks, block_size, ...]; a sequence's tokens live in the blocks its block table lists.
"""

from __future__ import annotations

import torch


def write_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Stores values[n] at flat slot slot_mapping[n] (slot = block * block_size + offset)."""
    cache.view(-1, *cache.shape[2:])[slot_mapping] = values


def gather_cache(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence, contiguous: [length, ...]."""
    return cache[block_table].flatten(0, 1)[:length]


def causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """True where query row i (at position context_len - query_len + i) must not see key j."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    return torch.arange(context_len, device=device)[None, :] > q_pos


def softmax_attention(scores: torch.Tensor, query_len: int, context_len: int, dtype: torch.dtype) -> torch.Tensor:
    """scores [..., Tq, Tk] (already scaled) -> probabilities in `dtype`, causal, softmax in float32."""
    if query_len > 1:
        scores = scores.masked_fill(causal_mask(query_len, context_len, scores.device), float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_starts: list[int],
                    query_lens: list[int], context_lens: list[int], block_tables: list[torch.Tensor],
                    scale: float) -> torch.Tensor:
    """Grouped-query attention. q [N, Hq, D]; caches [blocks, block_size, Hkv, D]; returns [N, Hq, Dv].

    The query heads sharing a KV head are stacked into one matrix per KV head, so K and V are read as
    they are cached instead of being repeated for every query head."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = q.new_empty(q.shape[0], hq, v_cache.shape[-1])
    for start, qlen, ctx, table in zip(query_starts, query_lens, context_lens, block_tables):
        qs = q[start:start + qlen].view(qlen, hkv, group, -1).permute(1, 2, 0, 3).reshape(hkv, group * qlen, -1)
        k = gather_cache(k_cache, table, ctx).permute(1, 2, 0).contiguous()
        v = gather_cache(v_cache, table, ctx).transpose(0, 1).contiguous()
        scores = torch.bmm(qs, k).view(hkv, group, qlen, ctx) * scale
        probs = softmax_attention(scores, qlen, ctx, q.dtype).view(hkv, group * qlen, ctx)
        o = torch.bmm(probs, v).view(hkv, group, qlen, -1)
        out[start:start + qlen] = o.permute(2, 0, 1, 3).reshape(qlen, hq, -1)
    return out
