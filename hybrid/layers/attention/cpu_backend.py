"""The cpu backend's attention: every row (decode, prefill and extend spans) through the C++ paged attention
kernel (cpu_kernels.attention), straight from the block tables, one call per layer; the step's keys and values go
into their cache slots through the kernels' store (which a CPU decode program records).

DeepSeek's MLA attends in latent space only for decode steps here; its prefill keeps the expanded form
(fewer FLOPs than latent space for long spans), whose per-head K and V are computed, not cached, and go
through the same kernel as one contiguous block (`causal`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cpu_kernels.attention import paged_attention, store_kv
from cpu_kernels.elementwise import copy_into
from cpu_kernels.linear import head_linear
from hybrid.layers.attention.backend import AttentionBackend, MlaWeights

if TYPE_CHECKING:
    from hybrid.layers.forward_batch import ForwardBatch


class CpuAttention(AttentionBackend):
    def __init__(self, num_threads: int | None = None):
        self.num_threads = num_threads

    def store(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        store_kv(cache, slot_mapping, values)

    def paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
              scale: float) -> torch.Tensor:
        tables, lens = batch.padded_tables
        return paged_attention(q, k_cache, v_cache, tables, lens, scale, batch.query_lens_tensor, self.num_threads)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        ctx = k.shape[0]
        table = torch.zeros(1, 1, dtype=torch.int32)
        lens = torch.tensor([ctx], dtype=torch.int32)
        return paged_attention(q, k.unsqueeze(0), v.contiguous().unsqueeze(0), table, lens, scale,
                               torch.tensor([q.shape[0]], dtype=torch.int32), self.num_threads)

    def mla_in_latent_space(self, batch: ForwardBatch) -> bool:
        return max(batch.query_lens) == 1

    def mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
            cache: torch.Tensor, weights: MlaWeights, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Latent-space decode with kv_b's per-head matrices on the kernels (the backend's torch einsums ran
        single-threaded over them: 33 MB per DeepSeek-V3 layer and step): the latent and rope key stored into
        their parts of the cache rows, the query absorbed into [latent | rope] in one buffer."""
        if weights.absorbed is None or not self.mla_in_latent_space(batch):
            return super().mla(q_nope, q_rope, latent, k_rope, cache, weights, batch, scale)
        w_uk_t, w_uv = weights.absorbed
        n, lora = latent.shape
        self.store(cache[..., :lora], batch.slot_mapping, latent)
        self.store(cache[..., lora:], batch.slot_mapping, k_rope)
        q = latent.new_empty(n, weights.num_heads, lora + weights.rope)
        head_linear(w_uk_t, q_nope, out=q[..., :lora])
        copy_into(q[..., lora:], q_rope)
        out_latent = self.paged(q, cache.unsqueeze(2), cache[..., :lora].unsqueeze(2), batch, scale)
        return head_linear(w_uv, out_latent).flatten(1)
