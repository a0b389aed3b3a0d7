"""The cpu backend's dense weights packed for the C++ kernels straight from the checkpoint: fp8 weights keep
their block scales, others are packed as bf16 (or the format asked for); linears sharing an input become one
matrix where their formats allow it."""

from __future__ import annotations

import torch

from hybrid.checkpoint.reader import CheckpointReader
from hybrid.checkpoint.shard import Shard
from hybrid.layers.linear import Linear, SharedInputLinears, shared_input_groups
from hybrid.layers.router import Router

# kv_b_proj stays a torch weight: MLA's expanded prefill reads it as one matrix, its absorbed decode as per-head
# matrices (pack_mla_absorption packs those from it).
UNPACKED_LINEARS = ("kv_b_proj",)


Part = tuple[str, tuple[int, ...], Shard | None]


def _pack_stacked(reader: CheckpointReader, parts: list[Part], fmt: str):
    """One PackedLinear of the weights `parts` (checkpoint name, local shape, tensor-parallel shard) stacked along
    their outputs, or None where fp8 block scales cannot be stacked with them (a part before the last ends inside
    a scale block, or fp8 parts beside others). An fp8 shard that cuts scale blocks is packed from bf16."""
    from cpu_kernels.linear import PackedLinear

    def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    fp8 = [fmt in ("auto", "fp8") and reader.is_fp8(name) for name, _, _ in parts]
    if all(fp8):
        if any(shape[0] % reader.fp8_block[0] for _, shape, _ in parts[:-1]):
            return None
        kept = [reader.fp8_shard(name, shape, shard) for name, shape, shard in parts]
        if all(k is not None for k in kept):
            return PackedLinear.pack(stacked([w for w, _ in kept]), "fp8", stacked([s for _, s in kept]),
                                     block=reader.fp8_block)
        if len(parts) > 1:
            return None
    elif any(fp8):
        return None
    weight = stacked([reader.weight(name, shape, torch.bfloat16, shard) for name, shape, shard in parts])
    return PackedLinear.pack(weight, "bf16" if fmt == "auto" or all(fp8) else fmt)


def pack_mla_absorption(model: torch.nn.Module) -> None:
    """DeepSeek's loaded kv_b_proj also as per-head bf16 matrices for the cpu backend's latent-space decode
    (CpuAttention.mla): W_UK^T [lora, nope] to absorb into the query, W_UV [v_dim, lora] to apply after the
    weighted sum. The torch weight stays for the expanded prefill path (its bytes once more, in bf16). Only where
    the model's kv_b values are bf16 values (always in bf16 runs): an fp8 checkpoint's dequantized kv_b in an
    fp32 run is not, and keeps torch's fp32 einsums."""
    from cpu_kernels.linear import PackedHeads
    from hybrid.layers.attention.backend import MlaWeights
    from hybrid.models.deepseek_v3 import DeepseekV3Attention

    for module in model.modules():
        if isinstance(module, DeepseekV3Attention):
            w = module.kv_b_proj.weight.data
            if not torch.equal(w, w.bfloat16().to(w.dtype)):
                continue
            w_uk, w_uv = MlaWeights(w.bfloat16(), module.num_heads, module.nope, module.rope_dim,
                                    module.v_dim).absorption()
            module.absorbed = (PackedHeads.pack(w_uk.transpose(1, 2)), PackedHeads.pack(w_uv))


def pack_dense_linears(model: torch.nn.Module, reader: CheckpointReader, fmt: str = "auto",
                       tied_embeddings: bool = False) -> None:
    """Moves every dense Linear to the CPU kernels straight from the checkpoint (before the other weights
    load, so no dequantized copy is ever made). Linears that share an input (SharedInputLinears) are packed
    as one matrix where their formats allow it. Routers keep the checkpoint's format: their logits choose the
    experts."""
    names = {id(module): name for name, module in model.named_modules()}
    stacked = set()
    for group in shared_input_groups(model):
        parts = [(f"{names[id(m)]}.weight", tuple(m.weight.shape), m.shard) for m in group.linears]
        packed = _pack_stacked(reader, parts, fmt)
        if packed is not None:
            group.use_kernel(packed)
            stacked.update(id(m) for m in group.linears)
    for name, module in model.named_modules():
        if (not isinstance(module, Linear) or name.rsplit(".", 1)[-1] in UNPACKED_LINEARS
                or id(module) in stacked):
            continue
        wname = f"{name}.weight"
        if wname not in reader and name == "lm_head" and tied_embeddings:
            wname = "model.embed_tokens.weight"
        module.use_kernel(_pack_stacked(reader, [(wname, tuple(module.weight.shape), module.shard)],
                                        "auto" if isinstance(module, Router) else fmt))


def decode_dense_bytes(model: torch.nn.Module) -> int:
    """Bytes of the loaded model's dense weights a decode step reads, the embedding table aside: the packed
    matrices, MLA's absorbed per-head copies where it has them (its kv_b weight serves prefill only then) and the
    torch parameters left."""
    embed = model.model.embed_tokens.weight
    absorbed = [m for m in model.modules() if getattr(m, "absorbed", None) is not None]
    prefill_only = {id(m.kv_b_proj.weight) for m in absorbed}
    total = sum(p.numel() * p.element_size() for p in model.parameters()
                if p is not embed and id(p) not in prefill_only)
    total += sum(m.packed.nbytes() for m in list(model.modules()) + shared_input_groups(model)
                 if isinstance(m, (Linear, SharedInputLinears)) and m.packed is not None)
    return total + sum(h.data.numel() * h.data.element_size() for m in absorbed for h in m.absorbed)
