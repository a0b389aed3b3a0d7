"""The hybrid runner's attention backend: KV stores and paged attention through the Triton kernels in gpu/.

A step whose rows are all single decode tokens uses split-KV decode; any other mix (prefill chunks,
extends, decodes together) uses the extend kernel. MLA attends in latent space (absorbed) unless a sequence of the
step brings at least EXPANDED_MLA_ROWS query rows: then prompt rows attend over per-head K and V expanded from the
latent (3.4x fewer FLOPs per score than the 576 + 512 wide latent for DeepSeek-V3, once the expansion is paid), with
the extend kernel over the expanded K and V cut into pages.
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


# Per query row, key and head, MLA in latent space multiplies over lora + rope (scores) and lora (values), 1088 for
# DeepSeek-V3, the expanded form over nope + rope and v_dim, 320, once each key is expanded per head, which costs
# lora x (nope + v_dim) per key and head: expanding pays from about 170 query rows of a sequence on.
EXPANDED_MLA_ROWS = 192
CAUSAL_PAGE = 64  # expanded K and V are passed to the extend kernel as pages of this many tokens


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
        return max(batch.query_lens) < EXPANDED_MLA_ROWS

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        ctx = k.shape[0]
        pad = -ctx % CAUSAL_PAGE  # rows past ctx are masked out: the kernel stops at the context length
        if pad:
            k, v = (torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in (k, v))
        k, v = (t.unflatten(0, (-1, CAUSAL_PAGE)) for t in (k, v))
        table = torch.arange(k.shape[0], dtype=torch.int32, device=q.device).view(1, -1)
        return extend_attention(q, k, v, table, [0], [q.shape[0]], [ctx], scale)
