"""The decoder-only causal LM skeleton both architectures share: embeddings, layers, final norm, lm_head.

A rank of a parallel run builds only its part (`ModelShard`): its pipeline stage's layers (the others are
`MissingLayer`s without weights), the embedding on the first stage, the final norm on the last, lm_head on the
driving rank; and within each layer its tensor-parallel share.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybrid.config import ModelConfig
from hybrid.distributed.tensor_parallel import ModelShard
from hybrid.experts.base import Experts
from hybrid.layers.add import Add
from hybrid.layers.forward_batch import ForwardBatch
from hybrid.layers.linear import Linear
from hybrid.layers.mlp import GatedMLP
from hybrid.layers.norm import RMSNorm
from hybrid.layers.parameter import empty_param
from hybrid.layers.rotary_embedding import RotaryEmbedding
from hybrid.models.overlap import interleave
from hybrid.models.segments import split_stages


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + self_attn(norm(x)), then x + mlp(norm(x)). A layer whose mlp is a RoutedMoe
    runs as a stage's segments (hybrid/models/segments.py); `forward` is the dense layer's whole step."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.residual = Add()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def attend(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.residual(x, self.self_attn(self.input_layernorm(x), batch))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.attend(x, batch)
        return self.residual(h, self.mlp(self.post_attention_layernorm(h)))


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage runs: no weights here."""


def decoder_layers(cfg: ModelConfig, experts: Experts, dtype: torch.dtype, attention: type[nn.Module],
                   moe: type[nn.Module], shard: ModelShard) -> list[nn.Module]:
    """One DecoderLayer per layer of this rank's stage: `attention`, and `moe` on MoE layers or a dense GatedMLP
    elsewhere; a MissingLayer for the other stages' layers."""
    rope = RotaryEmbedding(cfg.rope)
    tp = shard.tp
    return [
        DecoderLayer(cfg, attention(cfg, i, rope, dtype, tp),
                     moe(cfg, i, experts, dtype, tp) if i in cfg.moe_layers
                     else GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, tp), dtype)
        if shard.has_layer(i) else MissingLayer()
        for i in range(cfg.num_hidden_layers)
    ]


class CausalLMBody(nn.Module):
    """embed_tokens -> decoder layers -> norm, named as in the checkpoint (`model.*`), run as MoE stages and a
    tail (hybrid/models/segments.py)."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], dtype: torch.dtype, shard: ModelShard):
        super().__init__()
        if shard.embeds:
            self.embed_tokens = nn.Module()
            self.embed_tokens.weight = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if shard.final_norm else nn.Identity()
        self.stages, self.tail = split_stages([m for m in self.layers if not isinstance(m, MissingLayer)], self.norm)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.weight[input_ids]

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.forward_layers(self.embed(input_ids), batch)

    def forward_layers(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """This rank's layers (and the final norm on the last stage) over hidden states x."""
        for stage in self.stages:
            x = stage.begin(x, batch)()
        return self.tail(x, batch)

    def forward_overlapped(self, ids_a: torch.Tensor, batch_a: ForwardBatch, ids_b: torch.Tensor,
                           batch_b: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Dual-batch overlap: the routed experts of one micro-batch run (in the expert process) while the
        device runs the other's segments; a stage's wait stores its output for the micro-batch's next stage."""
        xs = [self.embed(ids_a), self.embed(ids_b)]
        batches = (batch_a, batch_b)

        def begin(mb: int, s: int) -> Callable[[], None]:
            finish = self.stages[s].begin(xs[mb], batches[mb])

            def wait() -> None:
                xs[mb] = finish()
            return wait

        interleave(len(self.stages), begin)
        return self.tail(xs[0], batch_a), self.tail(xs[1], batch_b)


class CausalLM(nn.Module):
    """A decoder stack plus lm_head. Subclasses build the layers."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], dtype: torch.dtype, shard: ModelShard):
        super().__init__()
        self.config, self.shard = cfg, shard
        self.model = CausalLMBody(cfg, layers, dtype, shard)
        if shard.logits:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """Shapes of the cache tensors of one layer (this rank's share of them)."""
        raise NotImplementedError
