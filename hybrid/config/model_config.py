"""Model configuration: a Hugging Face config.json parsed into the fields the models read."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class ConfigError(ValueError):
    """A model directory or engine setting that hybridd cannot run."""


@dataclass
class RopeConfig:
    """Rotary embedding parameters, normalized from `rope_scaling` (old) or `rope_parameters` (new)."""

    theta: float
    rotary_dim: int
    interleave: bool = False
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn"):
            raise ConfigError(f"rope type {self.rope_type!r} is not supported (default and yarn are)")
        if self.rotary_dim % 2:
            raise ConfigError(f"rotary dimension must be even, got {self.rotary_dim}")
        if self.rope_type == "yarn" and not self.original_max_position_embeddings:
            raise ConfigError("yarn rope scaling needs original_max_position_embeddings")


@dataclass
class ModelConfig:
    """The subset of a Qwen3-MoE / DeepSeek-V3 config.json that the models read."""

    model_dir: Path
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    checkpoint_dtype: torch.dtype
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    head_dim: int = 0
    moe_layers: list[int] = field(default_factory=list)
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    fp8_block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.moe_layers and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} with {self.num_experts} experts")
        if self.num_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.n_group > 1 and self.topk_group * self.num_experts // self.n_group < self.num_experts_per_tok:
            raise ConfigError("topk_group groups hold fewer experts than num_experts_per_tok")

    @property
    def is_mla(self) -> bool:
        return self.model_type == "deepseek_v3"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        model_type = SUPPORTED_ARCHITECTURES.get(arch) if arch else None
        if model_type is None or raw.get("model_type") not in (model_type, None):
            raise ConfigError(
                f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"hybridd runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        try:
            return _parse(model_dir, model_type, raw)
        except KeyError as e:
            raise ConfigError(f"{path}: missing field {e.args[0]!r}") from e


def _eos_ids(model_dir: Path, raw: dict) -> list[int]:
    ids = raw.get("eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id", ids)
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def _rope(raw: dict, rotary_dim: int, interleave: bool) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    known = {f for f in RopeConfig.__dataclass_fields__ if f not in ("theta", "rotary_dim", "interleave", "rope_type")}
    return RopeConfig(
        theta=float(theta), rotary_dim=rotary_dim, interleave=interleave, rope_type=rope_type,
        **{k: v for k, v in params.items() if k in known and v is not None},
    )


def _parse(model_dir: Path, model_type: str, raw: dict) -> ModelConfig:
    dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    common = dict(
        model_dir=model_dir, model_type=model_type, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"], moe_intermediate_size=raw["moe_intermediate_size"],
        num_experts_per_tok=raw["num_experts_per_tok"], norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), max_position_embeddings=raw["max_position_embeddings"],
        checkpoint_dtype=DTYPES.get(dtype_name, torch.bfloat16), eos_token_ids=_eos_ids(model_dir, raw),
        bos_token_id=raw.get("bos_token_id"), tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
    quant = raw.get("quantization_config")
    if quant:
        if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{model_dir}: quantization {quant.get('quant_method')!r} is not supported "
                              "(DeepSeek-style fp8 e4m3 block quantization is)")
        common["fp8_block"] = tuple(quant.get("weight_block_size") or (128, 128))
    layers = raw["num_hidden_layers"]
    if model_type == "qwen3_moe":
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        step = raw.get("decoder_sparse_step", 1)
        dense = set(raw.get("mlp_only_layers") or [])
        moe_layers = [i for i in range(layers) if i not in dense and raw["num_experts"] > 0 and (i + 1) % step == 0]
        return ModelConfig(
            **common, num_key_value_heads=raw["num_key_value_heads"], num_experts=raw["num_experts"],
            head_dim=head_dim, moe_layers=moe_layers, rope=_rope(raw, head_dim, interleave=False),
        )
    if raw.get("topk_method", "noaux_tc") != "noaux_tc" or raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"{model_dir}: only noaux_tc sigmoid routing (DeepSeek-V3/R1) is supported")
    first_dense = raw.get("first_k_dense_replace", 0)
    freq = raw.get("moe_layer_freq", 1)
    return ModelConfig(
        **common, num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        num_experts=raw["n_routed_experts"], n_shared_experts=raw.get("n_shared_experts") or 0,
        routed_scaling_factor=raw.get("routed_scaling_factor", 1.0), n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1, q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=raw["kv_lora_rank"], qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"], v_head_dim=raw["v_head_dim"],
        head_dim=raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"],
        moe_layers=[i for i in range(first_dense, layers) if i % freq == 0],
        rope=_rope(raw, raw["qk_rope_head_dim"], interleave=raw.get("rope_interleave", True)),
    )
