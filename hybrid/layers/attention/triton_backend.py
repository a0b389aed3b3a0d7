"""The hybrid runner's attention backend: KV stores and paged attention through the Triton kernels in gpu/.

A step whose rows are all single decode tokens uses split-KV decode; any other mix (prefill chunks,
extends, decodes together) uses the extend kernel. MLA always attends in latent space (absorbed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpu.decode_attention import decode_attention
from gpu.extend_attention import extend_attention
from gpu.kv_store import store_kv
from hybrid.layers.attention.backend import AttentionBackend

if TYPE_CHECKING:
    from hybrid.layers.forward_batch import ForwardBatch


class TritonAttention(AttentionBackend):
    graph_safe = True

    def store(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        store_kv(cache, slot_mapping, values)

    def paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
              scale: float) -> torch.Tensor:
        tables, ctx = batch.padded_tables
        if all(n == 1 for n in batch.query_lens) and batch.query_starts == list(range(batch.num_seqs)):
            return decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=batch.decode_splits)
        return extend_attention(q, k_cache, v_cache, tables, batch.query_starts, batch.query_lens,
                                batch.context_lens, scale)

    def mla_in_latent_space(self, batch: ForwardBatch) -> bool:
        return True
