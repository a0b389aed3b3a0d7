"""Qwen3-MoE: GQA attention with per-head q/k RMSNorm, softmax top-k routed experts, optional dense layers."""

from __future__ import annotations

import torch
from torch import nn

from hybrid.config import ModelConfig
from hybrid.experts.base import Experts
from hybrid.layers.forward_batch import ForwardBatch
from hybrid.layers.linear import Linear, SharedInputLinears
from hybrid.layers.moe import RoutedMoe
from hybrid.layers.norm import RMSNorm
from hybrid.layers.rotary_embedding import RotaryEmbedding
from hybrid.layers.router import SoftmaxTopKRouter
from hybrid.models.causal_lm import CausalLM, decoder_layers


class Qwen3MoeAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.layer, self.rope = layer, rope
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim ** -0.5
        h = cfg.hidden_size
        self.q_proj = Linear(h, self.num_heads * self.head_dim, dtype)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, dtype)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.qkv = SharedInputLinears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rope(batch, q, k)
        k_cache, v_cache = batch.kv_caches[self.layer]
        o = batch.attention.gqa(q, k, v, k_cache, v_cache, batch, self.scale)
        return self.o_proj(o.reshape(n, -1))


class Qwen3MoeSparseBlock(RoutedMoe):
    def __init__(self, cfg: ModelConfig, layer: int, experts: Experts, dtype: torch.dtype):
        super().__init__(layer, experts)
        self.gate = SoftmaxTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                      cfg.norm_topk_prob, dtype)


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, experts: Experts, dtype: torch.dtype):
        layers = decoder_layers(cfg, experts, dtype, Qwen3MoeAttention, Qwen3MoeSparseBlock)
        super().__init__(cfg, layers, dtype)
