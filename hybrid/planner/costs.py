"""What a model costs per token, from its config and its checkpoint's tensor headers (no weight is loaded): bytes
read per decode step, FLOPs per prefill token, attention FLOPs of a prefill and KV bytes, and one packed expert of
its shape and format, which sizes every expert read and copy exactly and feeds the probes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid.checkpoint.reader import LAYER, CheckpointReader
from hybrid.config import ModelConfig

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
    dense_stored_bytes: int  # those matrices as the checkpoint stores them (fp8 with scales, or bf16)
    lm_head_params: int

    @classmethod
    def from_dir(cls, model_dir: str | Path, expert_format: str = "auto") -> "ModelCosts":
        from cpu_kernels.moe import pack_experts
        from hybrid.experts.kernel_experts import default_expert_format

        config = ModelConfig.from_dir(model_dir)
        fmt = default_expert_format(config) if expert_format == "auto" else expert_format
        reader = CheckpointReader(config.model_dir, config.fp8_block)
        params = stored = lm_head = 0
        for name in reader.names():
            layer = LAYER.match(name)
            if ".mlp.experts." in name or "embed_tokens" in name or (layer and int(layer[1]) >=
                                                                     config.num_hidden_layers):
                continue  # routed experts (counted from the config), the embedding table, extra (MTP) layers
            shape, dtype = reader.stored(name)
            n = 1
            for d in shape:
                n *= d
            stored += n * STORED_BYTES.get(dtype, 2)
            if len(shape) == 2 and not name.endswith("_scale_inv"):
                params += n
                if name.startswith("lm_head"):
                    lm_head = n
        if config.tie_word_embeddings:
            lm_head = config.vocab_size * config.hidden_size
            params += lm_head
            stored += lm_head * 2
        g = torch.Generator().manual_seed(0)
        h, i = config.hidden_size, config.moe_intermediate_size
        w = lambda n, k: [torch.randn(n, k, generator=g) * 0.05]  # noqa: E731
        sample = pack_experts(w(i, h), w(i, h), w(h, i), fmt)
        return cls(config.model_dir.name, config, fmt, sample, params, stored, lm_head)

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
        """Bytes of the dense matrices a decode step reads: as stored, or at `compute_bytes` each (a GPU holds
        them in the compute dtype)."""
        return self.dense_stored_bytes if compute_bytes is None else self.dense_params * compute_bytes

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
