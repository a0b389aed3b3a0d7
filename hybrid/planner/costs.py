"""What a model costs per token, from its config and its checkpoint's tensor headers (no weight is loaded): bytes
read per decode step (the dense matrices as the CPU engine holds them in its dense format), FLOPs per prefill
token, attention FLOPs of a prefill and KV bytes, and one packed expert of its shape and format, which sizes every
expert read and copy exactly and feeds the probes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid.checkpoint.reader import LAYER, CheckpointReader
from hybrid.config import ModelConfig
from hybrid.config.engine_config import DENSE_FORMATS

STORED_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "I32": 4, "I64": 8}


@dataclass
class ModelCosts:
    """Per-token costs of one model. `dense_*` covers every matrix a token runs through outside the routed
    experts (attention projections, shared experts, dense MLPs, router, lm_head), not the embedding table."""

    name: str
    config: ModelConfig
    expert_format: str
    sample: object  # cpu_kernels PackedExperts: one expert of the model's shape and format
    dense_params: int
    # What a CPU decode step reads of them, packed for the kernels: in the checkpoint's format (fp8 with scales,
    # or bf16) for dense_format auto, else in dense_format; routers as stored and MLA's kv_b in bf16 either way.
    # A whole model's: a tensor-parallel rank holds its shard (and packs fp8 shards that cut blocks as bf16).
    dense_held_bytes: int
    lm_head_params: int
    dense_format: str = "auto"

    @property
    def dense_kernel_format(self) -> str:
        """The format the dense kernel runs most of the matrices in (what the probes time)."""
        if self.dense_format != "auto":
            return self.dense_format
        return "fp8" if self.config.fp8_block else "bf16"

    @classmethod
    def from_dir(cls, model_dir: str | Path, expert_format: str = "auto", dense_format: str = "auto") -> "ModelCosts":
        from cpu_kernels.moe import pack_experts
        from cpu_kernels.pack import packed_bytes
        from hybrid.experts.kernel_experts import default_expert_format

        if dense_format not in DENSE_FORMATS:
            raise ValueError(f"dense_format must be auto, bf16, fp8 or int8, got {dense_format!r}")

        config = ModelConfig.from_dir(model_dir)
        fmt = default_expert_format(config) if expert_format == "auto" else expert_format
        reader = CheckpointReader(config.model_dir, config.fp8_block)
        params = held = lm_head = 0
        block_k = config.fp8_block[1] if config.fp8_block else 128
        absorbed = 0
        if config.is_mla:
            absorbed = config.num_attention_heads * (
                packed_bytes("bf16", config.kv_lora_rank, config.qk_nope_head_dim)
                + packed_bytes("bf16", config.v_head_dim, config.kv_lora_rank))
        for name in reader.names():
            layer = LAYER.match(name)
            if ".mlp.experts." in name or "embed_tokens" in name or (layer and int(layer[1]) >=
                                                                     config.num_hidden_layers):
                continue  # routed experts (counted from the config), the embedding table, extra (MTP) layers
            shape, dtype = reader.stored(name)
            n = 1
            for d in shape:
                n *= d
            matrix = len(shape) == 2 and not name.endswith("_scale_inv")
            if ".kv_b_proj." in name:  # MLA decode reads its bf16 per-head copies (pack_mla_absorption)
                held += absorbed if matrix else 0
            elif matrix:  # packed as stored (routers always), else in dense_format; scale_inv goes into it
                # the checkpoint name of every Router (deepseek_v3, qwen3_moe), which dense_pack keeps as stored
                as_stored = dense_format == "auto" or ".mlp.gate.weight" in name
                fp8 = reader.is_fp8(name)
                fmt_m = ("fp8" if fp8 else "bf16") if as_stored else dense_format
                # stored fp8 keeps its block; pack_matrix quantizes others in 128 x 128 blocks
                held += packed_bytes(fmt_m, *shape, block_k=block_k if fp8 else 128)
            elif len(shape) != 2:
                held += n * STORED_BYTES.get(dtype, 2)
            if matrix:
                params += n
                if name.startswith("lm_head"):
                    lm_head = n
        if config.tie_word_embeddings and "lm_head.weight" not in reader:  # else counted above
            lm_head = config.vocab_size * config.hidden_size
            params += lm_head
            held += packed_bytes("bf16" if dense_format == "auto" else dense_format, config.vocab_size,
                                 config.hidden_size)
        g = torch.Generator().manual_seed(0)
        h, i = config.hidden_size, config.moe_intermediate_size
        w = lambda n, k: [torch.randn(n, k, generator=g) * 0.05]  # noqa: E731
        sample = pack_experts(w(i, h), w(i, h), w(h, i), fmt)
        return cls(config.model_dir.name, config, fmt, sample, params, held, lm_head, dense_format)

    @property
    def moe_layers(self) -> int:
        return len(self.config.moe_layers)

    @property
    def expert_bytes(self) -> int:
        """What the CPU kernel reads for one expert (weights, scales, the fp8 line flags)."""
        return self.sample.expert_bytes()

    @property
    def device_expert_bytes(self) -> int:
        """What streaming copies to the device for one expert."""
        from hybrid.experts.expert_stream import device_expert_bytes

        return device_expert_bytes(self.sample)

    @property
    def layer_bytes(self) -> int:
        """One MoE layer's experts as streamed."""
        return self.device_expert_bytes * self.config.num_experts

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts of one layer that `tokens` tokens route to (uniform routing)."""
        e, k = self.config.num_experts, self.config.num_experts_per_tok
        return e * (1 - (1 - k / e) ** tokens)

    def expert_flops_per_token(self) -> int:
        """Routed-expert FLOPs of one token in one MoE layer."""
        c = self.config
        return 2 * c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size

    def dense_flops_per_token(self) -> int:
        """Matrix FLOPs of one prefill token outside the routed experts and attention scores (lm_head only runs for
        the last token of a prompt: left out)."""
        return 2 * (self.dense_params - self.lm_head_params)

    def dense_bytes(self, compute_bytes: int | None) -> int:
        """Bytes of the dense matrices a decode step reads: as the CPU engine holds them, or at `compute_bytes`
        each (a GPU holds them in the compute dtype)."""
        return self.dense_held_bytes if compute_bytes is None else self.dense_params * compute_bytes

    def attention_dims(self, latent: bool) -> tuple[int, int, int, int]:
        """(query heads, KV heads, key dim, value dim) as the attention kernel sees them; MLA in latent space (the
        absorbed form) attends over the 512 + 64 latent, else over per-head expanded K and V."""
        c = self.config
        if c.is_mla:
            if latent:
                return c.num_attention_heads, 1, c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
            return c.num_attention_heads, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        return c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.head_dim

    def prefill_attention_flops(self, tokens: int, latent: bool) -> float:
        """Attention-score FLOPs of a causal prefill of `tokens` tokens over every layer (QK and PV, half the
        square each), plus MLA's expansion of the latent into per-head K and V when not in latent space."""
        c = self.config
        heads, _, dk, dv = self.attention_dims(latent)
        flops = c.num_hidden_layers * float(tokens) ** 2 * heads * (dk + dv)
        if c.is_mla and not latent:
            flops += c.num_hidden_layers * 2.0 * tokens * c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        return flops

    def kv_bytes_per_token(self, item_bytes: int) -> int:
        """KV cache bytes of one token of context over every layer (what a decode step reads per context token)."""
        c = self.config
        per_layer = (c.kv_lora_rank + c.qk_rope_head_dim) if c.is_mla else 2 * c.num_key_value_heads * c.head_dim
        return c.num_hidden_layers * per_layer * item_bytes
