"""DeepSeek-V3/R1: multi-head latent attention (MLA) over a compressed KV cache, shared + routed experts.

The cache holds, per token, the normalized KV latent [kv_lora_rank] and the roped shared key [qk_rope_head_dim].
Prompts expand the latent into per-head keys and values; single-token decode steps absorb kv_b_proj into
the query and output instead, so attention reads only the latent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybrid.attention import gather_cache, softmax_attention, write_cache
from hybrid.config import ModelConfig
from hybrid.forward_batch import ForwardBatch
from hybrid.models.causal_lm import CausalLM, decoder_layers
from hybrid.models.experts import Experts
from hybrid.models.layers import GatedMLP, Linear, RMSNorm, SharedInputLinears
from hybrid.models.rotary_embedding import RotaryEmbedding, yarn_softmax_scale
from hybrid.models.routed_moe import RoutedMoe
from hybrid.models.router import GroupedSigmoidRouter


class DeepseekV3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.layer, self.rope = layer, rope
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.lora = cfg.kv_lora_rank
        qk = self.nope + self.rope_dim
        h = cfg.hidden_size
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, self.num_heads * qk, dtype)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * qk, dtype)
        self.kv_a_proj_with_mqa = Linear(h, self.lora + self.rope_dim, dtype)
        self.kv_a_layernorm = RMSNorm(self.lora, 1e-6, dtype)
        self.kv_b_proj = Linear(self.lora, self.num_heads * (self.nope + self.v_dim), dtype)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, dtype)
        self.scale = yarn_softmax_scale(cfg.rope, qk ** -0.5)
        first = self.q_proj if cfg.q_lora_rank is None else self.q_a_proj
        self.x_projections = SharedInputLinears(first, self.kv_a_proj_with_mqa)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, kv_a = self.x_projections(x)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(n, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = kv_a.split([self.lora, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = self.rope(batch, q_rope, k_rope.view(n, 1, self.rope_dim))
        (cache,) = batch.kv_caches[self.layer]
        if batch.attention is not None and (batch.attention.latent_prefill or max(batch.query_lens) == 1):
            return self._latent_paged(q_nope, q_rope, latent, k_rope, cache, batch)
        write_cache(cache, batch.slot_mapping, torch.cat([latent, k_rope.view(n, self.rope_dim)], dim=-1))
        out = x.new_empty(n, self.num_heads * self.v_dim)
        for start, qlen, ctx, table in zip(batch.query_starts, batch.query_lens, batch.context_lens,
                                           batch.block_tables):
            kv = gather_cache(cache, table, ctx)
            rows = slice(start, start + qlen)
            if qlen == 1:
                o = self._absorbed(q_nope[rows], q_rope[rows], kv[:, :self.lora], kv[:, self.lora:], ctx)
            else:
                o = self._expanded(q_nope[rows], q_rope[rows], kv[:, :self.lora], kv[:, self.lora:], ctx,
                                   getattr(batch.attention, "causal", None))
            out[rows] = o.flatten(1)
        return self.o_proj(out)

    def _absorption(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, lora] and W_UV [H, v_dim, lora] out of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.lora)
        return w[:, :self.nope], w[:, self.nope:]

    def _latent_paged(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                      cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Every row (prefill, extend or decode) attends in latent space through batch.attention's kernels."""
        n = latent.shape[0]
        batch.attention.store(cache, batch.slot_mapping, torch.cat([latent, k_rope.view(n, self.rope_dim)], dim=-1))
        w_uk, w_uv = self._absorption()
        q_latent = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
        out_latent = batch.attention.mla(torch.cat([q_latent, q_rope], dim=-1), cache, self.lora, batch, self.scale)
        return self.o_proj(torch.einsum("nhl,hvl->nhv", out_latent, w_uv).flatten(1))

    def _expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                  ctx: int, causal: Callable | None = None) -> torch.Tensor:
        """Per-head K and V from the latent: [Tq, H, *] queries -> [Tq, H, v_dim]. `causal(q, k, v, scale)`, when
        given, attends instead of the matmuls here (the cpu backend's kernel)."""
        kv = self.kv_b_proj(latent).view(ctx, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None, :].expand(ctx, self.num_heads, self.rope_dim)], dim=-1)
        if causal is not None:
            return causal(torch.cat([q_nope, q_rope], dim=-1), k, v.contiguous(), self.scale)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)
        scores = torch.matmul(q, k.permute(1, 2, 0)) * self.scale
        probs = softmax_attention(scores, q.shape[1], ctx, q.dtype)
        return torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                  ctx: int) -> torch.Tensor:
        """Attention in latent space: W_UK folded into the query, W_UV applied after the weighted sum."""
        w_uk, w_uv = self._absorption()
        q_latent = torch.matmul(q_nope.transpose(0, 1), w_uk)
        scores = (torch.matmul(q_latent, latent.t()) + torch.matmul(q_rope.transpose(0, 1), k_rope.t())) * self.scale
        probs = softmax_attention(scores, q_nope.shape[0], ctx, q_nope.dtype)
        out_latent = torch.matmul(probs, latent)
        return torch.matmul(out_latent, w_uv.transpose(1, 2)).transpose(0, 1)


class DeepseekV3MoE(RoutedMoe):
    def __init__(self, cfg: ModelConfig, layer: int, experts: Experts, dtype: torch.dtype):
        super().__init__(layer, experts)
        self.gate = GroupedSigmoidRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group,
                                         cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor, dtype)
        self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)


class DeepseekV3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, experts: Experts, dtype: torch.dtype):
        layers = decoder_layers(cfg, experts, dtype, DeepseekV3Attention, DeepseekV3MoE)
        super().__init__(cfg, layers, dtype)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        cfg = self.config
        return [(num_blocks, block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)]
