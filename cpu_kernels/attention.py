"""Causal attention over a paged KV cache on the kernels' thread pool (csrc/attention.cpp), and its reference.

Each sequence brings a span of query tokens, the last of its context (decode: one). GQA: caches
[blocks, block_size, Hkv, D]. MLA in latent space: one KV head whose V is a column slice of the K cache
(`cache[..., :lora]`), read in place through its strides.
"""

from __future__ import annotations

import torch

from cpu_kernels.moe import resolve_isa, runner


def _check_cache(name: str, cache: torch.Tensor, dtype: torch.dtype) -> None:
    if cache.dim() != 4 or cache.dtype != dtype or cache.device.type != "cpu":
        raise ValueError(f"{name} cache must be a 4-d {dtype} CPU tensor [blocks, block_size, heads, dim], "
                         f"got {tuple(cache.shape)} {cache.dtype} on {cache.device}")
    if cache.stride(3) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise ValueError(f"{name} cache rows must be contiguous and its blocks evenly strided")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, query_lens: torch.Tensor | None = None,
                    num_threads: int | None = None, isa: int | None = None) -> torch.Tensor:
    """q [N, Hq, D] bf16 or fp32, sequence i's query_lens[i] rows after those of i - 1 (default: one each);
    k_cache [blocks, block_size, Hkv, D]; v_cache [blocks, block_size, Hkv, Dv] (may be a view into k_cache);
    block_tables [S, W] and context_lens [S] integers -> [N, Hq, Dv] in q's dtype. Query j of sequence i sits
    at position context_lens[i] - query_lens[i] + j and sees the keys up to it. Softmax and sums in fp32."""
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float32) or q.device.type != "cpu":
        raise ValueError(f"queries must be [N, heads, dim] bfloat16 or float32 on the CPU, got {tuple(q.shape)} "
                         f"{q.dtype} on {q.device}")
    _check_cache("K", k_cache, q.dtype)
    _check_cache("V", v_cache, q.dtype)
    n, hq, d = q.shape
    blocks, block_size, hkv, _ = k_cache.shape
    if k_cache.shape[3] != d or v_cache.shape[:3] != k_cache.shape[:3] or hq % hkv:
        raise ValueError(f"queries {tuple(q.shape)} do not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}")
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    seqs = lens.shape[0] if lens.dim() == 1 else -1
    qlens = torch.ones(max(seqs, 0)) if query_lens is None else query_lens
    qlens = qlens.to(torch.int32).contiguous()
    if tables.dim() != 2 or tables.shape[0] != seqs or qlens.shape != (seqs,):
        raise ValueError("block tables [S, W], context lengths [S] and query lengths [S] must agree")
    q = q.contiguous()
    out = torch.empty(n, hq, v_cache.shape[3], dtype=q.dtype)
    if n or seqs:  # the kernel checks the lengths and the block table entries it reads (ValueError)
        runner(num_threads).paged_attention(
            q.data_ptr(), out.data_ptr(), q.dtype == torch.float32, seqs, hq, hkv, d, v_cache.shape[3],
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1),
            v_cache.stride(2), block_size, tables.data_ptr(), tables.shape[1], lens.data_ptr(), qlens.data_ptr(),
            scale, n, blocks, resolve_isa(isa))
    return out


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                              query_lens: torch.Tensor | None = None) -> torch.Tensor:
    """The same in fp32 torch, one sequence at a time."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    qlens = [1] * len(context_lens) if query_lens is None else [int(x) for x in query_lens]
    out, row = [], 0
    for i, nq in enumerate(qlens):
        ctx = int(context_lens[i])
        k = k_cache[block_tables[i].long()].flatten(0, 1)[:ctx].float().repeat_interleave(hq // hkv, dim=1)
        v = v_cache[block_tables[i].long()].flatten(0, 1)[:ctx].float().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,thd->qht", q[row:row + nq].float(), k) * scale
        hidden = torch.arange(ctx)[None, :] > torch.arange(ctx - nq, ctx)[:, None]
        probs = torch.softmax(scores.masked_fill(hidden[:, None, :], float("-inf")), dim=-1)
        out.append(torch.einsum("qht,thd->qhd", probs, v))
        row += nq
    return torch.cat(out).to(q.dtype) if out else q.new_empty(0, hq, v_cache.shape[3])


def store_kv(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """values[i] into flat slot slots[i] of cache [blocks, block_size, ...] (slot = block * block_size + offset):
    a step's keys, values or latents. values [N, ...] with the cache's row shape and dtype; its rows may be
    strided (a column slice of a fused projection) but each row is contiguous. The cache may be a column view
    of a wider one (MLA's latent and rope key share a row) as long as each slot's part is contiguous. A slot
    outside the cache raises ValueError before anything is written."""
    row = cache.shape[2:]
    if (values.dtype != cache.dtype or values.shape[1:] != row or slots.dim() != 1
            or slots.shape[0] != values.shape[0] or cache.device.type != "cpu" or values.device.type != "cpu"):
        raise ValueError(f"store_kv needs values [N, {', '.join(map(str, row))}] {cache.dtype} and N slots, got "
                         f"{tuple(values.shape)} {values.dtype} and slots {tuple(slots.shape)}")
    if not cache[0, 0].is_contiguous() or cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise ValueError(f"store_kv writes equally spaced contiguous slots, got a cache of strides {cache.stride()}")
    row_elems = cache[0, 0].numel()
    if values.shape[0] and not values[0].is_contiguous():
        values = values.contiguous()
    slots = slots.to(torch.int64).contiguous()
    if values.shape[0]:
        runner().store_rows(cache.data_ptr(), cache.shape[0] * cache.shape[1], cache.stride(1) * cache.element_size(),
                            slots.data_ptr(), values.data_ptr(), values.stride(0) * values.element_size(),
                            values.shape[0], row_elems * values.element_size())


def store_kv_reference(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """The same in torch: an index_put into the flat cache rows."""
    cache.view(-1, *cache.shape[2:])[slots] = values
