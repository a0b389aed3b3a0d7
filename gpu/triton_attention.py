"""The hybrid runner's attention backend: KV stores and paged attention through the Triton kernels.

A step whose rows are all single decode tokens uses split-KV decode; any other mix (prefill chunks,
extends, decodes together) uses the extend kernel. MLA always attends in latent space (absorbed).
"""

from __future__ import annotations

import torch

from gpu.decode_attention import decode_attention
from gpu.extend_attention import extend_attention
from gpu.kv_store import store_kv
from hybrid.forward_batch import ForwardBatch


class TritonAttention:
    latent_prefill = True  # MLA prefill attends in latent space too (DeepseekV3Attention)

    def store(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        store_kv(cache, slot_mapping, values)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                scale: float) -> torch.Tensor:
        tables, ctx = batch.padded_tables
        if all(n == 1 for n in batch.query_lens) and batch.query_starts == list(range(batch.num_seqs)):
            return decode_attention(q, k, v, tables, ctx, scale, num_splits=batch.decode_splits)
        return extend_attention(q, k, v, tables, batch.query_starts, batch.query_lens, batch.context_lens, scale)

    def gqa(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
            scale: float) -> torch.Tensor:
        """q [N, Hq, D] over caches [blocks, page, Hkv, D] -> [N, Hq, D]."""
        return self._attend(q, k_cache, v_cache, batch, scale)

    def mla(self, q: torch.Tensor, cache: torch.Tensor, lora: int, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q [N, H, lora + rope] (nope part already absorbed) over the [latent | rope] cache -> [N, H, lora]."""
        return self._attend(q, cache.unsqueeze(2), cache[..., :lora].unsqueeze(2), batch, scale)
