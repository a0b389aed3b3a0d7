"""The CPU runner's attention backend: every row (decode, prefill and extend spans) through the C++ paged
attention kernel (cpu_kernels.attention), straight from the block tables, one call per layer.

DeepSeek's MLA attends in latent space only for decode steps here; its prefill keeps the expanded form
(DeepseekV3Attention: fewer FLOPs than latent space for long spans), whose per-head K and V are computed,
not cached, and go through the same kernel as one contiguous block (`causal`).
"""

from __future__ import annotations

import torch

from cpu_kernels.attention import paged_attention
from hybrid.attention import write_cache
from hybrid.forward_batch import ForwardBatch


class CpuAttention:
    latent_prefill = False

    def __init__(self, num_threads: int | None = None):
        self.num_threads = num_threads

    def store(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        write_cache(cache, slot_mapping, values)

    def gqa(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
            scale: float) -> torch.Tensor:
        """q [N, Hq, D] over caches [blocks, page, Hkv, D|Dv] -> [N, Hq, Dv]."""
        tables, lens = batch.padded_tables
        return paged_attention(q, k_cache, v_cache, tables, lens, scale, batch.query_lens_tensor,
                               self.num_threads)

    def mla(self, q: torch.Tensor, cache: torch.Tensor, lora: int, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q [N, H, lora + rope] (nope part already absorbed) over the [latent | rope] cache -> [N, H, lora]."""
        return self.gqa(q, cache.unsqueeze(2), cache[..., :lora].unsqueeze(2), batch, scale)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [Tq, H, D] at the last Tq of the ctx positions of k [ctx, Hkv, D] and v [ctx, Hkv, Dv] -> [Tq, H, Dv]."""
        ctx = k.shape[0]
        table = torch.zeros(1, 1, dtype=torch.int32)
        lens = torch.tensor([ctx], dtype=torch.int32)
        return paged_attention(q, k.unsqueeze(0), v.unsqueeze(0), table, lens, scale,
                               torch.tensor([q.shape[0]], dtype=torch.int32), self.num_threads)
