"""Loads a model onto its device, owns the paged KV cache and runs one scheduled batch to next-token logits."""

from __future__ import annotations

import math
import os

import torch

from hybrid.config import ConfigError, EngineConfig, ModelConfig
from hybrid.cpu_attention import CpuAttention
from hybrid.forward_batch import HostBatch
from hybrid.loader import CheckpointReader, load_weights
from hybrid.models import build_model
from hybrid.models.experts import Experts, load_experts
from hybrid.models.layers import Linear, RMSNorm, shared_input_groups
from hybrid.models.rotary_embedding import RotaryEmbedding
from hybrid.models.router import GroupedSigmoidRouter, SoftmaxTopKRouter
from hybrid.scheduler import ScheduledSeq

# kv_b_proj stays a torch weight: MLA's absorbed decode reads it as per-head matrices.
UNPACKED_LINEARS = ("kv_b_proj",)


def _pack_stacked(reader: CheckpointReader, parts: list[tuple[str, tuple[int, ...]]], fmt: str):
    """One PackedLinear of the weights `parts` (checkpoint name, shape) stacked along their outputs, or None
    where fp8 block scales cannot be stacked with them (a part before the last ends inside a scale block, or
    fp8 parts beside others)."""
    from cpu_kernels.linear import PackedLinear

    def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    fp8 = [fmt in ("auto", "fp8") and reader.is_fp8(name) for name, _ in parts]
    if all(fp8):
        if any(shape[0] % reader.fp8_block[0] for _, shape in parts[:-1]):
            return None
        return PackedLinear.pack(stacked([reader.checked(name, shape) for name, shape in parts]), "fp8",
                                 stacked([reader.get(f"{name}_scale_inv") for name, _ in parts]),
                                 block=reader.fp8_block)
    if any(fp8):
        return None
    weight = stacked([reader.weight(name, shape, torch.bfloat16) for name, shape in parts])
    return PackedLinear.pack(weight, "bf16" if fmt == "auto" else fmt)


def pack_dense_linears(model: torch.nn.Module, reader: CheckpointReader, fmt: str = "auto",
                       tied_embeddings: bool = False) -> None:
    """Moves every dense Linear to the CPU kernels straight from the checkpoint (before the other weights
    load, so no dequantized copy is ever made): fp8 weights stay fp8 with their own block scales, others
    are packed as bf16 unless `fmt` asks for another format. Linears that share an input
    (SharedInputLinears) are packed as one matrix where their formats allow it."""
    names = {id(module): name for name, module in model.named_modules()}
    stacked = set()
    for group in shared_input_groups(model):
        parts = [(f"{names[id(m)]}.weight", tuple(m.weight.shape)) for m in group.linears]
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
        module.use_kernel(_pack_stacked(reader, [(wname, tuple(module.weight.shape))], fmt))


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, experts: Experts | None = None):
        self.config = model_config
        self.dtype = engine_config.torch_dtype(model_config)
        if engine_config.backend == "cpu" and self.dtype == torch.float16:
            raise ConfigError("the cpu kernels compute in bfloat16 or float32, not float16: use dtype=bfloat16 "
                              "(--dtype bfloat16), or backend=torch")
        self.device = torch.device(engine_config.device)
        self.block_size = engine_config.block_size
        reader = CheckpointReader(model_config.model_dir, model_config.fp8_block)
        if engine_config.backend == "cpu":
            # The kernels' pinned pool owns the cores; torch's own intra-op threads would spin against it.
            torch.set_num_threads(1)
            if engine_config.experts == "process":
                from cpu_kernels.moe import set_pool_spin
                from cpu_kernels.thread_pool import SHARED_CORE_SPIN_US

                set_pool_spin(SHARED_CORE_SPIN_US)  # the expert process computes on these cores between calls
        if experts is None and engine_config.experts == "process":
            from hybrid.expert_client import process_experts

            fmt = None if engine_config.expert_format == "auto" else engine_config.expert_format
            experts = process_experts(model_config.model_dir, engine_config.max_num_batched_tokens,
                                      model_config.num_experts_per_tok, control=engine_config.expert_server,
                                      pack_dir=engine_config.expert_pack, fmt=fmt, threads=engine_config.num_threads,
                                      timeout_s=engine_config.expert_timeout_s)
        if experts is None:
            experts = load_experts(engine_config.backend, reader, model_config, self.dtype,
                                   engine_config.expert_format, engine_config.num_threads, engine_config.expert_pack)
        if engine_config.gpu_experts:
            from gpu.hot_experts import HotExperts

            experts = HotExperts(experts, reader, model_config, self.dtype, self.device, engine_config.gpu_experts,
                                 engine_config.expert_profile)
        self.experts = experts
        self.attention = None
        self.overlap = engine_config.hybrid and engine_config.overlap
        if engine_config.attention == "triton":
            if self.device.type == "cpu":
                # Triton kernels reach CPU tensors only through its interpreter, read when kernels are defined.
                os.environ.setdefault("TRITON_INTERPRET", "1")
            from gpu.triton_attention import TritonAttention

            self.attention = TritonAttention()
        elif engine_config.attention == "cpu":
            self.attention = CpuAttention(engine_config.num_threads)
        self.model = build_model(model_config, self.experts, self.dtype)
        if engine_config.backend == "cpu":
            pack_dense_linears(self.model, reader, engine_config.dense_format, model_config.tie_word_embeddings)
            for module in self.model.modules():
                if isinstance(module, (RMSNorm, RotaryEmbedding, SoftmaxTopKRouter, GroupedSigmoidRouter)):
                    module.use_kernel()
        load_weights(self.model, reader, model_config.tie_word_embeddings)
        self.model.to(self.device)
        per_token = sum(math.prod(s[2:]) for s in self.model.kv_cache_shapes(1, 1))
        bytes_per_token = per_token * self.dtype.itemsize * model_config.num_hidden_layers
        self.max_model_len, self.num_blocks = engine_config.resolve(model_config, bytes_per_token)
        # Graph replays keep per-sequence values in device tensors, which only the Triton attention reads.
        graphs = engine_config.hybrid and not engine_config.enforce_eager and engine_config.attention == "triton"
        # Graph replays point their padding rows at one extra block that the block manager never hands out.
        cache_blocks = self.num_blocks + 1 if graphs else self.num_blocks
        self.kv_caches = [
            tuple(torch.zeros(s, dtype=self.dtype, device=self.device)
                  for s in self.model.kv_cache_shapes(cache_blocks, self.block_size))
            for _ in range(model_config.num_hidden_layers)
        ]
        self.graphs = None
        if graphs:
            from gpu.decode_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model.model, self.kv_caches, self.attention, self.num_blocks,
                                       self.block_size, self.max_model_len, engine_config.max_num_seqs, self.dtype,
                                       self.device, lanes=2 if self.overlap else 1)

    def host_batch(self, batch: list[ScheduledSeq]) -> HostBatch:
        ids, positions, slots = [], [], []
        starts, lens, ctx_lens, tables, sample_rows = [], [], [], [], []
        for item in batch:
            seq, n = item.seq, item.num_tokens
            begin = seq.num_computed_tokens
            starts.append(len(ids))
            ids.extend(seq.token_ids[begin:begin + n])
            pos = range(begin, begin + n)
            positions.extend(pos)
            slots.extend(seq.block_table[p // self.block_size] * self.block_size + p % self.block_size for p in pos)
            lens.append(n)
            ctx_lens.append(begin + n)
            tables.append(list(seq.block_table))
            if item.samples:
                sample_rows.append(len(ids) - 1)
        return HostBatch(ids, positions, slots, starts, lens, ctx_lens, tables, sample_rows)

    def overlaps(self, batch: list[ScheduledSeq]) -> bool:
        """Dual-batch overlap runs decode steps of two or more sequences with the experts out of process."""
        return self.overlap and len(batch) >= 2 and all(item.num_tokens == 1 for item in batch)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], all_logits: bool = False) -> torch.Tensor:
        """Logits [num sampling seqs, vocab] in float32, or for every query row when all_logits is set.
        Decode steps replay captured graphs unless the engine runs eagerly or the batch is too large."""
        if not all_logits and self.overlaps(batch):
            half = len(batch) // 2
            a, b = self.host_batch(batch[:half]), self.host_batch(batch[half:])
            if self.graphs is not None and self.graphs.fits(a) and self.graphs.fits(b):
                hidden_a, hidden_b = self.graphs.run_overlapped(a, b)
            else:
                (ids_a, fb_a), (ids_b, fb_b) = (h.to_device(self.device, self.kv_caches, self.attention)
                                                for h in (a, b))
                hidden_a, hidden_b = self.model.model.forward_overlapped(ids_a, fb_a, ids_b, fb_b)
            return self.model.compute_logits(torch.cat([hidden_a[a.sample_rows], hidden_b[b.sample_rows]])).float()
        host = self.host_batch(batch)
        if not all_logits and self.graphs is not None and self.graphs.fits(host):
            hidden = self.graphs.run(host)
        else:
            input_ids, fb = host.to_device(self.device, self.kv_caches, self.attention)
            hidden = self.model(input_ids, fb)
        if not all_logits:
            hidden = hidden[host.sample_rows]
        return self.model.compute_logits(hidden).float()
