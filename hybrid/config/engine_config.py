"""Engine configuration: batch limits, KV pool size, compute dtype, kernels and where attention and experts run."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid.config.model_config import DTYPES, ConfigError, ModelConfig, torch_dtype

if TYPE_CHECKING:
    import torch

# An engine does both phases of a request, or, disaggregated, only prefills (then hands each sequence off after
# its first token) or takes over prefilled sequences and decodes them.
ROLES = ("both", "prefill", "decode")
# The weight formats the cpu backend packs routed experts and dense linears in (auto: the checkpoint's).
EXPERT_FORMATS = ("auto", "bf16", "fp8", "int8", "int4")
DENSE_FORMATS = ("auto", "bf16", "fp8", "int8")


@dataclass
class EngineConfig:
    """Limits of one engine instance: batch sizes, KV pool and compute dtype."""

    model: str | Path
    dtype: str = "auto"
    device: str = "cpu"
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    seed: int = 0
    backend: str = "cpu"
    expert_format: str = "auto"
    dense_format: str = "auto"
    num_threads: int | None = None
    expert_pack: str | Path | None = None
    experts: str = "inline"
    expert_server: str | None = None
    expert_timeout_s: float = 30.0
    gpus: list[int] | None = None
    attn_device: str | None = None
    attention: str = "auto"
    overlap: str = "auto"
    enforce_eager: bool = False
    gpu_experts: int = 0
    expert_profile: str | None = None
    enable_prefix_caching: bool = True
    role: str = "both"
    tp: int = 1
    pp: int = 1
    all_reduce: str = "auto"
    slp_threshold: str | int = "auto"
    slp_max_tokens: int | None = None
    slp_copy: str = "auto"
    grammar_masks: str = "process"

    def __post_init__(self) -> None:
        if isinstance(self.overlap, bool):
            self.overlap = "on" if self.overlap else "off"
        if self.grammar_masks not in ("process", "inline"):
            raise ConfigError(f"grammar_masks must be process or inline, got {self.grammar_masks!r}")
        if self.overlap not in ("auto", "on", "off"):
            raise ConfigError(f"overlap must be auto, on or off, got {self.overlap!r}")
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.gpus is not None:
            self._hybrid()
        if self.attention not in ("auto", "torch", "cpu", "triton"):
            raise ConfigError(f"attention must be auto, torch, cpu or triton, got {self.attention!r}")
        if self.attention == "auto":
            self.attention = "cpu" if self.backend == "cpu" else "torch"
        if self.attention == "cpu" and (self.backend != "cpu" or self.gpus is not None):
            raise ConfigError("attention=cpu is the cpu backend's C++ paged attention; use backend=cpu without --gpus")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError("num_kv_blocks must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")
        if self.kv_cache_bytes < 1:
            raise ConfigError(f"kv_cache_bytes (--kv-cache-gb) must be positive, got {self.kv_cache_bytes}")
        if self.backend not in ("cpu", "torch"):
            raise ConfigError(f"backend must be cpu (C++ kernels) or torch (reference), got {self.backend!r}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ConfigError(f"expert_format must be auto, bf16, fp8, int8 or int4, got {self.expert_format!r}")
        if self.dense_format not in DENSE_FORMATS:
            raise ConfigError(f"dense_format must be auto, bf16, fp8 or int8, got {self.dense_format!r}")
        if self.backend == "cpu" and self.device != "cpu":
            raise ConfigError(f"the cpu kernels run on the CPU; device={self.device!r} needs backend=torch")
        if self.experts not in ("inline", "process"):
            raise ConfigError(f"experts must be inline or process, got {self.experts!r}")
        if self.expert_server is not None and self.experts != "process":
            raise ConfigError("expert_server is the control address of an expert process: use experts=process")
        if self.expert_timeout_s <= 0:
            raise ConfigError("expert_timeout_s must be positive")
        if self.backend == "torch" and self.experts == "process" and self.gpus is None:
            raise ConfigError("the expert process runs the cpu kernels; use backend=cpu with experts=process")
        if self.backend == "torch" and self.expert_pack is not None and self.gpus is None:
            raise ConfigError("an expert pack is run by the cpu backend's kernels, not the torch reference")
        if self.backend == "torch" and (self.dense_format != "auto" or (self.expert_format != "auto"
                                                                        and self.gpus is None)):
            raise ConfigError("expert_format / dense_format need the cpu backend; the torch reference computes "
                              "with the checkpoint's weights in the compute dtype")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads must be >= 1")
        if (self.gpu_experts or self.expert_profile) and self.gpus is None:
            raise ConfigError("gpu_experts / expert_profile keep experts on a GPU: use them with --gpus")
        if self.expert_profile and not self.gpu_experts:
            raise ConfigError("expert_profile picks the experts --gpu-experts N keeps on the GPU: give N too")
        if self.gpu_experts < 0:
            raise ConfigError("gpu_experts must be >= 0")
        self._parallel()
        self._streamed_prefill()

    def _streamed_prefill(self) -> None:
        """--slp-threshold / --slp-max-tokens / --slp-copy: long prefills streaming their experts to the device."""
        try:
            self.slp_threshold = parse_slp_threshold(self.slp_threshold)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.slp_copy not in ("auto", "register", "bounce"):
            raise ConfigError(f"slp_copy must be auto, register or bounce, got {self.slp_copy!r}")
        if self.slp_max_tokens is not None and self.slp_max_tokens < 1:
            raise ConfigError("slp_max_tokens must be >= 1")
        if self.gpus is None and (isinstance(self.slp_threshold, int) or self.slp_max_tokens is not None
                                  or self.slp_copy != "auto"):
            raise ConfigError("streamed prefill (--slp-threshold N, --slp-max-tokens, --slp-copy) streams experts to "
                              "a GPU: use it with --gpus (--attn-device cpu plays the GPU on the CPU)")

    @property
    def streams_prefill(self) -> bool:
        """Whether long prefills may stream their experts to the device (the hybrid path unless turned off)."""
        return self.gpus is not None and self.slp_threshold != "off" and self.role != "decode"

    def _parallel(self) -> None:
        """--tp / --pp: CPU-only ranks (hybrid/distributed/), each with its experts in its own process."""
        if self.tp < 1 or self.pp < 1:
            raise ConfigError(f"tp and pp must be >= 1, got tp={self.tp} pp={self.pp}")
        if self.all_reduce not in ("auto", "shm", "gloo"):
            raise ConfigError(f"all_reduce must be auto, shm or gloo, got {self.all_reduce!r}")
        if self.world_size == 1:
            return
        if self.gpus is not None:
            raise ConfigError("--tp / --pp split a CPU-only run over NUMA nodes and machines; with --gpus use one "
                              "rank (SmallEP is the multi-GPU path)")
        if self.experts != "inline":
            raise ConfigError("--tp / --pp ranks compute their experts in their own process: use experts=inline")
        if self.expert_pack is not None:
            raise ConfigError("--tp / --pp ranks pack their own share of the experts in their NUMA node's memory; "
                              "an expert pack holds whole experts: leave --expert-pack out")
        if self.role != "both":
            raise ConfigError("--tp / --pp run one engine per rank group; prefill/decode disaggregation is not "
                              "combined with them")

    def _hybrid(self) -> None:
        """--gpus: attention, KV cache and dense layers on the device (torch + Triton attention), routed
        experts in the expert process. attn_device="cpu" plays the GPU's role on the CPU, same code path."""
        import torch

        if not self.gpus or any(g < 0 for g in self.gpus):
            raise ConfigError(f"gpus must list CUDA device indices, got {self.gpus}")
        if len(set(self.gpus)) != len(self.gpus):
            raise ConfigError(f"gpus lists a device twice: {self.gpus}")
        if self.attn_device != "cpu" and torch.cuda.is_available() and max(self.gpus) >= torch.cuda.device_count():
            raise ConfigError(f"gpus {self.gpus}: torch sees {torch.cuda.device_count()} GPU(s)")
        device = self.attn_device or f"cuda:{self.gpus[0]}"
        if device not in ("cpu",) and not device.startswith("cuda"):
            raise ConfigError(f"attn_device must be cpu or cuda[:N], got {device!r}")
        if len(self.gpus) > 1 and device != "cpu" and (torch.device(device).index or 0) != self.gpus[0]:
            raise ConfigError(f"with several --gpus the first (cuda:{self.gpus[0]}) runs attention and holds the KV "
                              f"cache; --attn-device {device} would put two ranks on one GPU")
        if device.startswith("cuda") and torch.cuda.is_available() \
                and (torch.device(device).index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"attn_device {device}: torch sees {torch.cuda.device_count()} GPU(s)")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--gpus {','.join(map(str, self.gpus))} needs CUDA, and torch sees no GPU here; "
                              "use --cpu-only, or --attn-device cpu to run the hybrid path with the CPU as device")
        self.device, self.backend, self.experts = device, "torch", "process"
        if self.attention == "auto":
            self.attention = "triton"

    @property
    def world_size(self) -> int:
        """Ranks of a parallel run (--tp x --pp); 1 without one."""
        return self.tp * self.pp

    @property
    def hybrid(self) -> bool:
        return self.gpus is not None

    def torch_dtype(self, model: ModelConfig) -> torch.dtype:
        return model.checkpoint_dtype if self.dtype == "auto" else torch_dtype(self.dtype)

    def resolve(self, model: ModelConfig, kv_bytes_per_token: int) -> tuple[int, int]:
        """Returns (max_model_len, num_kv_blocks), checking that one full-length sequence fits the pool. The pool
        is num_kv_blocks, else what four full-length sequences need (at most max_num_seqs) within kv_cache_bytes."""
        if self.max_model_len is not None and self.max_model_len > model.max_position_embeddings:
            raise ConfigError(f"max_model_len={self.max_model_len} is beyond the {model.max_position_embeddings} "
                              "positions this model was made for (max_position_embeddings in its config.json)")
        max_len = self.max_model_len or model.max_position_embeddings
        blocks = self.num_kv_blocks
        if blocks is None:
            wanted = math.ceil(max_len / self.block_size) * min(self.max_num_seqs, 4)
            affordable = self.kv_cache_bytes // (kv_bytes_per_token * self.block_size)
            blocks = max(1, min(wanted, affordable))
        if blocks * self.block_size < max_len:
            if self.max_model_len is not None:
                raise ConfigError(
                    f"the KV pool holds {blocks * self.block_size} tokens, less than max_model_len={max_len}; "
                    "raise num_kv_blocks / kv_cache_bytes (--num-kv-blocks / --kv-cache-gb) or lower max_model_len"
                )
            max_len = blocks * self.block_size
        return max_len, blocks


def parse_slp_threshold(value: str | int) -> str | int:
    """'auto', 'off' or a positive token count; anything else is refused naming the value."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"slp_threshold must be auto, off or a token count >= 1, got {value}")
        return value
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return text
    try:
        return parse_slp_threshold(int(text))
    except ValueError:
        raise ValueError(f"slp_threshold must be auto, off or a token count >= 1, got {value!r}") from None
