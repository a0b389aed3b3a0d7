"""Decode attention over a paged KV cache on the kernels' thread pool (csrc/attention.cpp), and its reference.

One query token per sequence. GQA: caches [blocks, block_size, Hkv, D]. MLA in latent space: one KV head
whose V is a column slice of the K cache (`cache[..., :lora]`), read in place through its strides.
"""

from __future__ import annotations

import torch

from cpu_kernels.moe import kernel_isa, runner


def _check_cache(name: str, cache: torch.Tensor, dtype: torch.dtype) -> None:
    if cache.dim() != 4 or cache.dtype != dtype or cache.device.type != "cpu":
        raise ValueError(f"{name} cache must be a 4-d {dtype} CPU tensor [blocks, block_size, heads, dim], "
                         f"got {tuple(cache.shape)} {cache.dtype} on {cache.device}")
    if cache.stride(3) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise ValueError(f"{name} cache rows must be contiguous and its blocks evenly strided")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, num_threads: int | None = None,
                     isa: int | None = None) -> torch.Tensor:
    """q [N, Hq, D] bf16 or fp32; k_cache [blocks, block_size, Hkv, D]; v_cache [blocks, block_size, Hkv, Dv]
    (may be a view into k_cache); block_tables [N, W] and context_lens [N] integers -> [N, Hq, Dv] in q's dtype.
    Softmax and sums in fp32."""
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
    if tables.dim() != 2 or tables.shape[0] != n or lens.shape != (n,):
        raise ValueError(f"{n} sequences need block tables [{n}, W] and context lengths [{n}]")
    if n and (int(lens.min()) < 1 or int(lens.max()) > tables.shape[1] * block_size):
        raise ValueError(f"context lengths must be in [1, {tables.shape[1] * block_size}]")
    if n and tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= blocks):
        raise ValueError(f"block tables must index the cache's {blocks} blocks")
    q = q.contiguous()
    out = torch.empty(n, hq, v_cache.shape[3], dtype=q.dtype)
    if n:
        runner(num_threads).decode_attention(
            q.data_ptr(), out.data_ptr(), q.dtype == torch.float32, n, hq, hkv, d, v_cache.shape[3],
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1),
            v_cache.stride(2), block_size, tables.data_ptr(), tables.shape[1], lens.data_ptr(), scale,
            kernel_isa() if isa is None else isa)
    return out


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The same in fp32 torch, one sequence at a time."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    out = []
    for i in range(q.shape[0]):
        ctx = int(context_lens[i])
        k = k_cache[block_tables[i].long()].flatten(0, 1)[:ctx].float().repeat_interleave(hq // hkv, dim=1)
        v = v_cache[block_tables[i].long()].flatten(0, 1)[:ctx].float().repeat_interleave(hq // hkv, dim=1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[i].float(), k) * scale, dim=-1)
        out.append(torch.einsum("ht,thd->hd", probs, v))
    return torch.stack(out).to(q.dtype) if out else q.new_empty(0, hq, v_cache.shape[3])
