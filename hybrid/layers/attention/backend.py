"""The attention-backend interface: how a model's attention writes and reads the paged KV cache.

A backend supplies `paged` (every query row of a step over its sequence's cached context), may replace the
torch defaults of `store` (rows into cache slots) and `causal` (query rows over one contiguous K/V block), and
says per step whether DeepSeek's MLA attends every row in latent space. From those this class builds what models call:
`gqa` for grouped-query attention and `mla` for multi-head latent attention. Models call those two methods
only and never ask which backend they have.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gpu.paged_reference import gather_cache, softmax_attention, write_cache

if TYPE_CHECKING:
    from hybrid.layers.forward_batch import ForwardBatch


@dataclass
class MlaWeights:
    """A layer's kv_b_proj weight [H * (nope + v_dim), lora] and head shapes: MLA absorbs it into the query and
    output (W_UK, W_UV) or expands the latent with it into per-head K and V."""

    kv_b: torch.Tensor
    num_heads: int
    nope: int
    rope: int
    v_dim: int
    absorbed: tuple | None = None  # (W_UK^T, W_UV) packed per head for the CPU kernels (cpu_kernels.linear)

    def absorption(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, lora] and W_UV [H, v_dim, lora], views of kv_b."""
        w = self.kv_b.view(self.num_heads, self.nope + self.v_dim, -1)
        return w[:, :self.nope], w[:, self.nope:]


class AttentionBackend(ABC):
    """Attention over the paged KV cache. A cache is [num_blocks, block_size, ...]; a sequence's tokens live in
    the blocks its block table lists (ForwardBatch.block_tables / padded_tables)."""

    # Whether `paged` reads per-sequence values (context lengths, tables) only from device tensors, so a captured
    # graph that replays it with rewritten inputs attends correctly (the decode graphs need this).
    graph_safe = False

    def store(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        """values[n] into flat slot slot_mapping[n] (slot = block * block_size + offset). In torch here; a backend
        with a kernel for it overrides this."""
        write_cache(cache, slot_mapping, values)

    @abstractmethod
    def paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
              scale: float) -> torch.Tensor:
        """q [N, Hq, D] of every sequence of the step over caches [blocks, page, Hkv, D|Dv] -> [N, Hq, Dv]."""

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [Tq, H, D] at the last Tq of the ctx positions of k [ctx, H, D] and v [ctx, H, Dv] -> [Tq, H, Dv].
        In torch here; a backend with a kernel for it overrides this."""
        ctx = k.shape[0]
        qt = q.transpose(0, 1)
        scores = torch.matmul(qt, k.permute(1, 2, 0)) * scale
        probs = softmax_attention(scores, qt.shape[1], ctx, q.dtype)
        return torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)

    @abstractmethod
    def mla_in_latent_space(self, batch: ForwardBatch) -> bool:
        """Whether every row of this step attends in latent space through `paged` (else per sequence: decode rows
        absorbed, prompt rows expanded into per-head K and V through `causal`)."""

    def gqa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Stores this step's k, v [N, Hkv, D] and attends q [N, Hq, D] -> [N, Hq, D]."""
        self.store(k_cache, batch.slot_mapping, k)
        self.store(v_cache, batch.slot_mapping, v)
        return self.paged(q, k_cache, v_cache, batch, scale)

    def mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
            cache: torch.Tensor, weights: MlaWeights, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Stores this step's [latent | k_rope] rows in the MLA cache and attends: q_nope [N, H, nope], q_rope
        [N, H, rope], latent [N, lora], k_rope [N, rope] -> [N, H * v_dim] (before o_proj)."""
        n, lora = latent.shape
        self.store(cache, batch.slot_mapping, torch.cat([latent, k_rope], dim=-1))
        if self.mla_in_latent_space(batch):
            w_uk, w_uv = weights.absorption()
            q_latent = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
            out_latent = self.paged(torch.cat([q_latent, q_rope], dim=-1), cache.unsqueeze(2),
                                    cache[..., :lora].unsqueeze(2), batch, scale)
            return torch.einsum("nhl,hvl->nhv", out_latent, w_uv).flatten(1)
        out = latent.new_empty(n, weights.num_heads * weights.v_dim)
        for start, qlen, ctx, table in zip(batch.query_starts, batch.query_lens, batch.context_lens,
                                           batch.block_tables):
            kv = gather_cache(cache, table, ctx)
            rows = slice(start, start + qlen)
            if qlen == 1:
                o = absorbed_mla(q_nope[rows], q_rope[rows], kv[:, :lora], kv[:, lora:], weights, scale)
            else:
                o = self._expanded(q_nope[rows], q_rope[rows], kv[:, :lora], kv[:, lora:], weights, scale)
            out[rows] = o.flatten(1)
        return out

    def _expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                  weights: MlaWeights, scale: float) -> torch.Tensor:
        """Per-head K and V expanded from the latent (fewer FLOPs than latent space for long spans):
        [Tq, H, *] queries -> [Tq, H, v_dim]."""
        ctx, h = latent.shape[0], weights.num_heads
        kv = F.linear(latent, weights.kv_b).view(ctx, h, weights.nope + weights.v_dim)
        k_nope, v = kv.split([weights.nope, weights.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None, :].expand(ctx, h, weights.rope)], dim=-1)
        return self.causal(torch.cat([q_nope, q_rope], dim=-1), k, v, scale)


def absorbed_mla(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
              weights: MlaWeights, scale: float) -> torch.Tensor:
    """Attention in latent space in torch: W_UK folded into the query, W_UV applied after the weighted sum."""
    w_uk, w_uv = weights.absorption()
    q_latent = torch.matmul(q_nope.transpose(0, 1), w_uk)
    scores = (torch.matmul(q_latent, latent.t()) + torch.matmul(q_rope.transpose(0, 1), k_rope.t())) * scale
    probs = softmax_attention(scores, q_nope.shape[0], latent.shape[0], q_nope.dtype)
    out_latent = torch.matmul(probs, latent)
    return torch.matmul(out_latent, w_uv.transpose(1, 2)).transpose(0, 1)
