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
from hybrid.layers.attention.backend import AttentionBackend

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
