"""The pure-torch attention backend: paged attention as batched matmuls per sequence (gpu/paged_reference.py).
The reference for the other backends, and the path of `--backend torch`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpu.paged_reference import paged_attention
from hybrid.layers.attention.backend import AttentionBackend

if TYPE_CHECKING:
    from hybrid.layers.forward_batch import ForwardBatch


class TorchAttention(AttentionBackend):
    def paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
              scale: float) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, batch.query_starts, batch.query_lens, batch.context_lens,
                               batch.block_tables, scale)

    def mla_in_latent_space(self, batch: ForwardBatch) -> bool:
        return False
