"""The decoder-only causal LM skeleton both architectures share: embeddings, layers, final norm, lm_head."""

from __future__ import annotations

import torch
from torch import nn

from hybrid.config import ModelConfig
from hybrid.forward_batch import ForwardBatch
from hybrid.models.experts import Experts
from hybrid.models.layers import GatedMLP, Linear, RMSNorm, empty_param
from hybrid.models.rotary_embedding import RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + self_attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


def decoder_layers(cfg: ModelConfig, experts: Experts, dtype: torch.dtype, attention: type[nn.Module],
                   moe: type[nn.Module]) -> list[DecoderLayer]:
    """One DecoderLayer per layer: `attention`, and `moe` on MoE layers or a dense GatedMLP elsewhere."""
    rope = RotaryEmbedding(cfg.rope)
    return [
        DecoderLayer(cfg, attention(cfg, i, rope, dtype),
                     moe(cfg, i, experts, dtype) if i in cfg.moe_layers
                     else GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype), dtype)
        for i in range(cfg.num_hidden_layers)
    ]


class CausalLMBody(nn.Module):
    """embed_tokens -> decoder layers -> norm, named as in the checkpoint (`model.*`)."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens.weight[input_ids]
        for layer in self.layers:
            x = layer(x, batch)
        return self.norm(x)


class CausalLM(nn.Module):
    """A decoder stack plus lm_head. Subclasses build the layers."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.model = CausalLMBody(cfg, layers, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """Shapes of the cache tensors of one layer."""
        cfg = self.config
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        return [shape, shape]
