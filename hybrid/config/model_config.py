"""Model configuration: a Hugging Face config.json parsed into the fields the models read."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

# The embedded model every command runs when none is named.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "default_model"

# model_type values of checkpoints whose architecture we run under another name (Kimi-K2 is DeepSeek-V3's).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}

# Compute dtypes by name. torch is imported where a dtype is asked for, not with this module: the supervisor, the
# api process and `hybridd stop` / `status` read configs and would otherwise each spend ~2 s importing it.
DTYPES = ("bfloat16", "float32", "float16")
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "intermediate_size", "moe_intermediate_size", "num_experts_per_tok", "head_dim", "n_group", "topk_group")
# The most each size may be. No dimension, count or token id of a real model comes near 2**31 (above it tensor
# sizes overflow int64); DeepSeek-V3 has 61 layers, and transformers' config class lists every one; real heads
# are 64-256 wide, and the rotary tables are built from them before any weight is read.
MAX_SIZE = 2**31 - 1
SIZE_LIMITS = {
    **dict.fromkeys(SIZES + ("num_experts", "n_shared_experts", "kv_lora_rank", "q_lora_rank"), MAX_SIZE),
    **dict.fromkeys(("head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), 65536),
    "num_hidden_layers": 4096,
}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


class ConfigError(ValueError):
    """A model directory or engine setting that hybridd cannot run."""


class FileConfigError(ConfigError):
    """A ConfigError whose message already names the file at fault (not config.json)."""


def check_positive(owner: object, ints: tuple[str, ...] = (), floats: tuple[str, ...] = (),
                   optional: tuple[str, ...] = ()) -> None:
    """Refuses fields that must be positive: `ints` as integers, `floats` as finite numbers; `optional` ones
    (listed in either) may also be None. The message names the field, as the file spells it."""
    for name in ints + floats:
        v = getattr(owner, name)
        if v is None and name in optional:
            continue
        if name in ints:
            ok = isinstance(v, int) and not isinstance(v, bool) and v > 0
            what = "a positive integer"
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            what = "a positive finite number"
        if not ok:
            raise ConfigError(f"{name} must be {what}, got {v!r}")


def check_at_most(name: str, v: object) -> None:
    """Refuses an integer size above its SIZE_LIMITS bound (other types are left to the type checks)."""
    if isinstance(v, int) and v > SIZE_LIMITS[name]:
        raise ConfigError(f"{name} must be at most {SIZE_LIMITS[name]}, got {v}")


@dataclass
class RopeConfig:
    """Rotary embedding parameters, normalized from `rope_scaling` (old) or `rope_parameters` (new)."""

    rope_theta: float
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
        check_positive(self, floats=("rope_theta", "factor", "beta_fast", "beta_slow", "attention_factor"),
                       ints=("original_max_position_embeddings",),
                       optional=("attention_factor", "original_max_position_embeddings"))
        for name in ("mscale", "mscale_all_dim"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise ConfigError(f"{name} must be a finite number, got {v!r}")
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
        check_positive(self, ints=SIZES + ("max_position_embeddings",),
                       floats=("rms_norm_eps", "routed_scaling_factor"))
        for name in SIZE_LIMITS:
            check_at_most(name, getattr(self, name))
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ConfigError(f"the number of routed experts must be >= 0, got {self.num_experts!r}")
        if not isinstance(self.n_shared_experts, int) or self.n_shared_experts < 0:
            raise ConfigError(f"n_shared_experts must be >= 0, got {self.n_shared_experts!r}")
        if self.moe_layers and self.num_experts == 0:
            raise ConfigError("MoE layers with 0 routed experts")
        if self.is_mla:
            check_positive(self, ints=("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                       "q_lora_rank"), optional=("q_lora_rank",))
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
        """Parses config.json through transformers' own config class for the architecture (which knows every
        renamed field and old spelling), then validates the numbers into this dataclass."""
        model_dir = Path(model_dir)
        model_type, raw = read_config(model_dir)
        try:
            return _parse(model_dir, model_type, _hf_config(model_type, raw))
        except FileConfigError:
            raise
        except ConfigError as e:
            raise ConfigError(f"{model_dir / 'config.json'}: {e}") from None


def read_config(model_dir: Path) -> tuple[str, dict]:
    """config.json's architecture and fields, checked as far as can be without transformers (whose config classes
    take seconds to import): the file exists, is a JSON object and names an architecture hybridd runs."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return _model_type(path, raw), raw


def _model_type(path: Path, raw: dict) -> str:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{path}: architectures must be a list of class names, got {archs!r}")
    if not isinstance(raw.get("model_type"), (str, type(None))):
        raise ConfigError(f"{path}: model_type must be a name, got {raw['model_type']!r}")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    declared = MODEL_TYPE_ALIASES.get(raw.get("model_type"), raw.get("model_type"))
    model_type = SUPPORTED_ARCHITECTURES[arch] if arch else declared
    if model_type not in SUPPORTED_ARCHITECTURES.values() or declared not in (model_type, None):
        raise ConfigError(f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; "
                          f"hybridd runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    return model_type


def _hf_config(model_type: str, raw: dict):
    """The transformers config object for `raw`; its type checks become one-line ConfigErrors."""
    import torch
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    cls = Qwen3MoeConfig if model_type == "qwen3_moe" else DeepseekV3Config
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "architectures")}
    for name in ("torch_dtype", "dtype"):
        if isinstance(v := fields.get(name), str) and not isinstance(getattr(torch, v, None), torch.dtype):
            raise ConfigError(f"{name} {v!r} is not a torch dtype")
    check_at_most("num_hidden_layers", fields.get("num_hidden_layers"))  # before the class lists every layer
    try:
        return cls.from_dict(fields)
    except Exception as e:  # the class's strict field validators raise their own types; all mean a bad file
        raise ConfigError(" ".join(str(e).split())) from None


def _eos_ids(model_dir: Path, hf) -> list[int]:
    """generation_config.json's eos_token_id where it has one, else config.json's."""
    ids, source = hf.eos_token_id, None
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            raw = json.loads(gen.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FileConfigError(f"{gen}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise FileConfigError(f"{gen}: not a JSON object")
        if "eos_token_id" in raw:
            ids, source = raw["eos_token_id"], gen
    if ids is None:
        return []
    ids = [ids] if isinstance(ids, int) else ids
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        msg = f"eos_token_id must be a token id or a list of them, got {ids!r}"
        raise FileConfigError(f"{source}: {msg}") if source else ConfigError(msg)
    return ids


def _rope(hf, rotary_dim: int, interleave: bool) -> RopeConfig:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    known = set(RopeConfig.__dataclass_fields__) - {"rope_theta", "rotary_dim", "interleave", "rope_type"}
    return RopeConfig(
        rope_theta=theta, rotary_dim=rotary_dim, interleave=interleave, rope_type=rope_type,
        **{k: v for k, v in params.items() if k in known and v is not None},
    )


def _dtype(hf) -> torch.dtype:
    import torch

    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype) if dtype in DTYPES else torch.bfloat16
    return dtype if dtype in [torch_dtype(name) for name in DTYPES] else torch.bfloat16


def _parse(model_dir: Path, model_type: str, hf) -> ModelConfig:
    common = dict(
        model_dir=model_dir, model_type=model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
        intermediate_size=hf.intermediate_size, moe_intermediate_size=hf.moe_intermediate_size,
        num_experts_per_tok=hf.num_experts_per_tok, norm_topk_prob=bool(hf.norm_topk_prob),
        rms_norm_eps=hf.rms_norm_eps, max_position_embeddings=hf.max_position_embeddings,
        checkpoint_dtype=_dtype(hf), eos_token_ids=_eos_ids(model_dir, hf),
        bos_token_id=hf.bos_token_id, tie_word_embeddings=bool(hf.tie_word_embeddings),
    )
    quant = getattr(hf, "quantization_config", None)
    if quant:
        if not isinstance(quant, dict) and not hasattr(quant, "to_dict"):
            raise ConfigError(f"quantization_config must be an object, got {quant!r}")
        quant = quant if isinstance(quant, dict) else quant.to_dict()
        if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"quantization {quant.get('quant_method')!r} is not supported "
                              "(DeepSeek-style fp8 e4m3 block quantization is)")
        block = quant.get("weight_block_size") or (128, 128)
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
        common["fp8_block"] = tuple(block)
    layers = hf.num_hidden_layers
    if model_type == "qwen3_moe":
        head_dim = getattr(hf, "head_dim", None) or _div(hf.hidden_size, hf.num_attention_heads)
        step = _at_least(hf, "decoder_sparse_step", 1)
        dense = set(hf.mlp_only_layers or [])
        moe_layers = [i for i in range(layers) if i not in dense and hf.num_experts > 0 and (i + 1) % step == 0]
        return ModelConfig(
            **common, num_key_value_heads=hf.num_key_value_heads, num_experts=hf.num_experts,
            head_dim=head_dim, moe_layers=moe_layers, rope=_rope(hf, head_dim, interleave=False),
        )
    if getattr(hf, "topk_method", "noaux_tc") != "noaux_tc" or getattr(hf, "scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError("only noaux_tc sigmoid routing (DeepSeek-V3/R1) is supported")
    first_dense = _at_least(hf, "first_k_dense_replace", 0)
    freq = _at_least(hf, "moe_layer_freq", 1)
    return ModelConfig(
        **common, num_key_value_heads=hf.num_key_value_heads or hf.num_attention_heads,
        num_experts=hf.n_routed_experts, n_shared_experts=hf.n_shared_experts or 0,
        routed_scaling_factor=hf.routed_scaling_factor, n_group=hf.n_group or 1,
        topk_group=hf.topk_group or 1, q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
        head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim,
        moe_layers=[i for i in range(first_dense, layers) if i % freq == 0],
        rope=_rope(hf, hf.qk_rope_head_dim, interleave=hf.rope_interleave),
    )


def _at_least(hf, name: str, minimum: int) -> int:
    """An optional integer field of the config that must be >= minimum (absent or null: minimum)."""
    v = getattr(hf, name, None)
    if v is None:
        return minimum
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


def _div(a, b) -> int:
    if not isinstance(a, int) or not isinstance(b, int) or b <= 0:
        raise ConfigError(f"hidden_size {a!r} / num_attention_heads {b!r} gives no head_dim")
    return a // b
