"""Qwen3-MoE: GQA attention with per-head q/k RMSNorm, softmax top-k routed experts, optional dense layers.

Tensor-parallel, each rank holds a share of the query heads and the KV heads they read: its share of the KV heads
where the rank count divides them, else the one KV head of its query heads (replicated on the ranks sharing it).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid.checkpoint.shard import Shard
from hybrid.config import ConfigError, ModelConfig
from hybrid.distributed.tensor_parallel import ModelShard, TensorParallel
from hybrid.experts.base import Experts
from hybrid.layers.forward_batch import ForwardBatch
from hybrid.layers.linear import Linear, SharedInputLinears, column_parallel, row_parallel
from hybrid.layers.moe import RoutedMoe
from hybrid.layers.norm import RMSNorm
from hybrid.layers.rotary_embedding import RotaryEmbedding
from hybrid.layers.router import SoftmaxTopKRouter
from hybrid.models.causal_lm import CausalLM, decoder_layers


def local_kv_heads(cfg: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """(first, count) of the KV heads this rank holds."""
    kv = cfg.num_key_value_heads
    if kv % tp.size == 0:
        return tp.split(kv, "KV heads")
    if tp.size % kv:
        raise ConfigError(f"--tp {tp.size} must divide the model's {kv} KV heads or be a multiple of them")
    return tp.rank // (tp.size // kv), 1


class Qwen3MoeAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, dtype: torch.dtype,
                 tp: TensorParallel):
        super().__init__()
        self.layer, self.rope, self.tp = layer, rope, tp
        self.head_dim = d = cfg.head_dim
        self.scale = d ** -0.5
        h = cfg.hidden_size
        self.q_proj = column_parallel(h, cfg.num_attention_heads * d, dtype, tp, unit=d, what="attention heads")
        self.num_heads = self.q_proj.out_features // d
        first_kv, self.num_kv_heads = local_kv_heads(cfg, tp)
        full_kv = cfg.num_key_value_heads * d
        kv_shard = None if tp.size == 1 else Shard(0, first_kv * d, self.num_kv_heads * d, full_kv)
        self.k_proj = Linear(h, self.num_kv_heads * d, dtype, kv_shard)
        self.v_proj = Linear(h, self.num_kv_heads * d, dtype, kv_shard)
        self.o_proj = row_parallel(cfg.num_attention_heads * d, h, dtype, tp, unit=d, what="attention heads")
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
        return self.tp.all_reduce(self.o_proj(o.reshape(n, -1)))


class Qwen3MoeSparseBlock(RoutedMoe):
    def __init__(self, cfg: ModelConfig, layer: int, experts: Experts, dtype: torch.dtype, tp: TensorParallel):
        super().__init__(layer, experts, tp)
        self.gate = SoftmaxTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                      cfg.norm_topk_prob, dtype)


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, experts: Experts, dtype: torch.dtype, shard: ModelShard):
        layers = decoder_layers(cfg, experts, dtype, Qwen3MoeAttention, Qwen3MoeSparseBlock, shard)
        super().__init__(cfg, layers, dtype, shard)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        shape = (num_blocks, block_size, local_kv_heads(self.config, self.shard.tp)[1], self.config.head_dim)
        return [shape, shape]
