"""The decoder-only causal LM skeleton both architectures share: embeddings, layers, final norm, lm_head."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybrid.config import ModelConfig
from hybrid.dual_batch import interleave
from hybrid.forward_batch import ForwardBatch
from hybrid.models.experts import Experts
from hybrid.models.layers import GatedMLP, Linear, RMSNorm, empty_param
from hybrid.models.rotary_embedding import RotaryEmbedding
from hybrid.models.routed_moe import RoutedMoe


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + self_attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def attend(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return x + self.self_attn(self.input_layernorm(x), batch)

    def begin_mlp(self, h: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Starts h + mlp(norm(h)); an MoE block's routed experts may still be running when this returns."""
        y = self.post_attention_layernorm(h)
        if isinstance(self.mlp, RoutedMoe):
            finish = self.mlp.begin(y)
            return lambda: h + finish()
        out = h + self.mlp(y)
        return lambda: out

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.begin_mlp(self.attend(x, batch))()


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

    def forward_overlapped(self, ids_a: torch.Tensor, batch_a: ForwardBatch, ids_b: torch.Tensor,
                           batch_b: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Dual-batch overlap: the routed experts of one micro-batch run (in the expert process) while
        the device runs the other's attention. A stage is one layer: attention, then the MLP started; its
        wait stores the layer's output for the micro-batch's next stage."""
        xs = [self.embed_tokens.weight[ids_a], self.embed_tokens.weight[ids_b]]
        batches = (batch_a, batch_b)

        def begin(mb: int, i: int) -> Callable[[], None]:
            layer = self.layers[i]
            finish = layer.begin_mlp(layer.attend(xs[mb], batches[mb]))

            def wait() -> None:
                xs[mb] = finish()
            return wait

        interleave(len(self.layers), begin)
        return self.norm(xs[0]), self.norm(xs[1])


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
