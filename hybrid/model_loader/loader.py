"""Builds a model from the registry, fills its weights from the checkpoint and puts it on its device. With the
cpu backend its dense linears (routers' logits included) are packed for the C++ kernels first and its norms,
rotary embedding, adds and dense MLPs' activation switch to their kernels."""

from __future__ import annotations

import torch

from hybrid.checkpoint.reader import CheckpointReader
from hybrid.config import EngineConfig, ModelConfig
from hybrid.distributed.tensor_parallel import ModelShard
from hybrid.experts.base import Experts
from hybrid.layers.add import Add
from hybrid.layers.mlp import GatedMLP
from hybrid.layers.norm import RMSNorm
from hybrid.layers.parameter import fill_param
from hybrid.layers.rotary_embedding import RotaryEmbedding
from hybrid.model_loader.dense_pack import pack_dense_linears, pack_mla_absorption
from hybrid.models.causal_lm import CausalLM
from hybrid.models.registry import build_model

KERNEL_MODULES = (RMSNorm, RotaryEmbedding, Add, GatedMLP)


def load_weights(module: torch.nn.Module, reader: CheckpointReader, tied_embeddings: bool = False) -> None:
    """Fills every parameter of `module` from the checkpoint tensor of the same name (a tensor-parallel linear's
    from its shard of it), checking shapes."""
    for prefix, owner in module.named_modules():
        for pname, param in list(owner.named_parameters(recurse=False)):
            name = f"{prefix}.{pname}" if prefix else pname
            source = name
            if name == "lm_head.weight" and name not in reader and tied_embeddings:
                source = "model.embed_tokens.weight"
            shard = getattr(owner, "shard", None) if pname == "weight" else None
            fill_param(owner, pname, reader.weight(source, tuple(param.shape), param.dtype, shard))


def load_model(model_config: ModelConfig, engine_config: EngineConfig, reader: CheckpointReader, experts: Experts,
               dtype: torch.dtype, device: torch.device, shard: ModelShard | None = None) -> CausalLM:
    model = build_model(model_config, experts, dtype, shard)
    if engine_config.backend == "cpu":
        pack_dense_linears(model, reader, engine_config.dense_format, model_config.tie_word_embeddings)
        for module in model.modules():
            if isinstance(module, KERNEL_MODULES):
                module.use_kernel()
    load_weights(model, reader, model_config.tie_word_embeddings)
    if engine_config.backend == "cpu":
        pack_mla_absorption(model)
    return model.to(device)
