"""DeepSeek-V3/R1: multi-head latent attention (MLA) over a compressed KV cache, shared + routed experts.

The cache holds, per token, the normalized KV latent [kv_lora_rank] and the roped shared key [qk_rope_head_dim].
The attention backend decides per step whether rows attend in latent space (kv_b_proj absorbed into the query
and output) or expand the latent into per-head keys and values (hybrid/layers/attention/backend.py).

Tensor-parallel, each rank holds a share of the heads (their query, kv_b and output rows / columns) and the whole
latent cache: every head reads the same per-token latent, so splitting it would split nothing but the heads'
reads of it; the latent projection is replicated (576 values per token and layer on DeepSeek-V3).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid.config import ModelConfig
from hybrid.distributed.tensor_parallel import ModelShard, TensorParallel
from hybrid.experts.base import Experts
from hybrid.layers.attention.backend import MlaWeights
from hybrid.layers.forward_batch import ForwardBatch
from hybrid.layers.linear import Linear, SharedInputLinears, column_parallel, row_parallel
from hybrid.layers.mlp import GatedMLP
from hybrid.layers.moe import RoutedMoe
from hybrid.layers.norm import RMSNorm
from hybrid.layers.rotary_embedding import RotaryEmbedding, yarn_softmax_scale
from hybrid.layers.router import GroupedSigmoidRouter
from hybrid.models.causal_lm import CausalLM, decoder_layers


class DeepseekV3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, dtype: torch.dtype,
                 tp: TensorParallel):
        super().__init__()
        self.layer, self.rope, self.tp = layer, rope, tp
        heads = cfg.num_attention_heads
        self.num_heads = heads // tp.size
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.lora = cfg.kv_lora_rank
        qk = self.nope + self.rope_dim
        h = cfg.hidden_size
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = column_parallel(h, heads * qk, dtype, tp, unit=qk, what="attention heads")
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = column_parallel(cfg.q_lora_rank, heads * qk, dtype, tp, unit=qk, what="attention heads")
        self.kv_a_proj_with_mqa = Linear(h, self.lora + self.rope_dim, dtype)
        self.kv_a_layernorm = RMSNorm(self.lora, 1e-6, dtype)
        self.kv_b_proj = column_parallel(self.lora, heads * (self.nope + self.v_dim), dtype, tp,
                                         unit=self.nope + self.v_dim, what="attention heads")
        self.o_proj = row_parallel(heads * self.v_dim, h, dtype, tp, unit=self.v_dim, what="attention heads")
        self.scale = yarn_softmax_scale(cfg.rope, qk ** -0.5)
        first = self.q_proj if cfg.q_lora_rank is None else self.q_a_proj
        self.x_projections = SharedInputLinears(first, self.kv_a_proj_with_mqa)
        self.absorbed = None  # kv_b_proj per head, packed by the cpu backend's loader (pack_mla_absorption)

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
        weights = MlaWeights(self.kv_b_proj.weight, self.num_heads, self.nope, self.rope_dim, self.v_dim,
                             self.absorbed)
        out = batch.attention.mla(q_nope, q_rope, latent, k_rope.view(n, self.rope_dim), cache, weights, batch,
                                  self.scale)
        return self.tp.all_reduce(self.o_proj(out))


class DeepseekV3MoE(RoutedMoe):
    def __init__(self, cfg: ModelConfig, layer: int, experts: Experts, dtype: torch.dtype, tp: TensorParallel):
        super().__init__(layer, experts, tp)
        self.gate = GroupedSigmoidRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group,
                                         cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor, dtype)
        self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype,
                                       tp, reduce=False)


class DeepseekV3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, experts: Experts, dtype: torch.dtype, shard: ModelShard):
        layers = decoder_layers(cfg, experts, dtype, DeepseekV3Attention, DeepseekV3MoE, shard)
        super().__init__(cfg, layers, dtype, shard)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        cfg = self.config
        return [(num_blocks, block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)]
