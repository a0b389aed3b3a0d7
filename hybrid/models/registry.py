"""Model architectures hybridd runs, keyed by the `model_type` of their config.json."""

from __future__ import annotations

import torch

from hybrid.config import ModelConfig
from hybrid.distributed.tensor_parallel import ModelShard
from hybrid.experts.base import Experts
from hybrid.models.causal_lm import CausalLM
from hybrid.models.deepseek_v3 import DeepseekV3ForCausalLM
from hybrid.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
}


def build_model(cfg: ModelConfig, experts: Experts, dtype: torch.dtype, shard: ModelShard | None = None) -> CausalLM:
    """The model, or the part of it `shard` says this rank holds."""
    return MODEL_CLASSES[cfg.model_type](cfg, experts, dtype, shard or ModelShard())
