"""Loads a model onto its device, owns its KV pool and runs one scheduled batch to next-token logits.

The runner builds itself in named steps: parallel run, threads, experts, attention backend, model, KV pool,
decode graphs (CUDA graphs on the hybrid path, recorded kernel programs CPU-only). In a parallel run (--tp /
--pp) every rank builds a runner over its part of the model; the driver's steps run on all of them
(hybrid/engine/stage_executor.py), the others `follow`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from hybrid.checkpoint.reader import CheckpointReader
from hybrid.config import ConfigError, EngineConfig, ModelConfig
from hybrid.distributed.communicator import CommunicationError
from hybrid.engine.overlap_policy import OverlapPolicy
from hybrid.engine.scheduler import ScheduledSeq, prefilling
from hybrid.experts.base import Experts
from hybrid.experts.loader import build_experts
from hybrid.layers.attention.backend import AttentionBackend
from hybrid.layers.attention.registry import create_attention_backend
from hybrid.layers.forward_batch import HostBatch
from hybrid.mem_cache.kv_pool import KVPool
from hybrid.model_loader.loader import load_model
from hybrid.models.causal_lm import CausalLM

log = logging.getLogger(__name__)
T = TypeVar("T")

if TYPE_CHECKING:
    from hybrid.distributed.launcher import ParallelRun
    from hybrid.engine.stage_executor import StageExecutor
    from hybrid.graphs.cpu_decode_programs import CpuDecodePrograms
    from hybrid.graphs.decode_graphs import DecodeGraphs


def timed(took: dict[str, float], name: str, build: Callable[[], T]) -> T:
    """Runs one build step, logging its start (a start that hangs is the log's last line) and keeping its time."""
    log.info("building the runner: %s", name)
    start = time.perf_counter()
    built = build()
    took[name] = time.perf_counter() - start
    return built


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, experts: Experts | None = None):
        self.config, self.engine_config = model_config, engine_config
        self.dtype = engine_config.torch_dtype(model_config)
        if engine_config.backend == "cpu" and self.dtype == torch.float16:
            raise ConfigError("the cpu kernels compute in bfloat16 or float32, not float16: use dtype=bfloat16 "
                              "(--dtype bfloat16), or backend=torch")
        self.device = torch.device(engine_config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # Triton launches on the current device, whatever its tensors' are
        self.block_size = engine_config.block_size
        self.overlap = engine_config.hybrid and engine_config.overlap != "off"
        self.overlap_policy = OverlapPolicy(engine_config.overlap if self.overlap else "off")
        reader = CheckpointReader.of_model(model_config)
        self.parallel = self.init_parallel()
        self.step_streamed_bytes = 0
        try:
            self.shard = None if self.parallel is None else \
                self.parallel.state.model_shard(model_config.num_hidden_layers)
            self.init_threads()
            took: dict[str, float] = {}
            self.experts = timed(took, "experts", lambda: self.init_experts(reader, experts))
            self.attention = self.init_attention()
            self.model = timed(took, "model", lambda: self.init_model(reader))
            self.kv_pool = timed(took, "KV pool", self.init_kv_pool)
            self.graphs = timed(took, "decode graphs", self.init_graphs)
            self.executor = self.init_executor()
            log.info("runner built: %s", ", ".join(f"{name} {s:.1f} s" for name, s in took.items()))
        except BaseException:
            if self.parallel is not None:
                self.parallel.abort()
            raise

    def init_parallel(self) -> ParallelRun | None:
        if self.engine_config.world_size == 1:
            return None
        from hybrid.distributed.launcher import ParallelRun

        return ParallelRun.join(self.engine_config)

    def init_executor(self) -> StageExecutor | None:
        if self.parallel is None:
            return None
        from hybrid.engine.stage_executor import StageExecutor

        return StageExecutor(self.parallel.state, self.model.model, self.kv_pool.caches, self.attention,
                             self.config.hidden_size, self.dtype, self.device, self.graphs)

    def init_threads(self) -> None:
        threads = self.engine_config.num_threads
        if self.engine_config.backend != "cpu":
            if threads is not None:
                torch.set_num_threads(threads)
            return
        from cpu_kernels.moe import set_default_threads

        # The kernels' pinned pool owns the cores; torch's own intra-op threads would spin against it.
        torch.set_num_threads(1)
        set_default_threads(threads)
        if self.engine_config.experts == "process":
            from cpu_kernels.moe import set_pool_spin
            from cpu_kernels.thread_pool import SHARED_CORE_SPIN_US

            set_pool_spin(SHARED_CORE_SPIN_US)  # the expert process computes on these cores between calls

    def init_experts(self, reader: CheckpointReader, given: Experts | None) -> Experts:
        return build_experts(self.engine_config, self.config, reader, self.dtype, self.device, given, self.shard)

    def long_prefill(self) -> tuple[int, int] | None:
        """(fewest, most) tokens of a prefill that streams its experts in one pass; None when none would."""
        window = getattr(self.experts, "window", None)
        return None if window is None else window()

    def init_attention(self) -> AttentionBackend:
        return create_attention_backend(self.engine_config.attention, self.device, self.engine_config.num_threads)

    def init_model(self, reader: CheckpointReader) -> CausalLM:
        return load_model(self.config, self.engine_config, reader, self.experts, self.dtype, self.device, self.shard)

    @property
    def uses_graphs(self) -> bool:
        """Graph replays keep per-sequence values in device tensors, which only a graph-safe backend reads."""
        return self.engine_config.hybrid and not self.engine_config.enforce_eager and self.attention.graph_safe

    @property
    def uses_programs(self) -> bool:
        """CPU-only decode steps replay kernel programs where every call of the step is a kernel: the cpu backend's
        attention and recordable experts (in-process kernels, or the expert process's slot calls). In a parallel
        run every rank records its own part; the shared-memory all-reduce is a kernel too (gloo's is not: such
        steps are refused and run eagerly)."""
        from hybrid.layers.attention.cpu_backend import CpuAttention

        return (self.engine_config.backend == "cpu" and not self.engine_config.hybrid
                and not self.engine_config.enforce_eager and self.experts.recordable
                and type(self.attention) is CpuAttention)

    def init_kv_pool(self) -> KVPool:
        """Sizes the pool from the engine's limits (which also fixes the context length) and allocates it."""
        token_shapes = [s[2:] for s in self.model.kv_cache_shapes(1, 1)]
        layers = self.config.num_hidden_layers
        per_token = KVPool.bytes_per_token(token_shapes, layers, self.dtype)
        self.max_model_len, num_blocks = self.engine_config.resolve(self.config, per_token)
        # Graph replays point their padding rows at one extra block that the block manager never hands out.
        held = self.shard.layers if self.shard else None
        return KVPool(token_shapes, layers, num_blocks, self.block_size, self.dtype, self.device,
                      extra_blocks=1 if self.uses_graphs else 0, held_layers=held)

    def init_graphs(self) -> DecodeGraphs | CpuDecodePrograms | None:
        if self.uses_programs:
            from hybrid.graphs.cpu_decode_programs import CpuDecodePrograms

            # One process: the lm_head is recorded too. Pipeline stages hand hidden states on; the driver's head runs
            # after the last stage's.
            return CpuDecodePrograms(self.model.model, self.kv_pool.caches, self.attention, self.experts,
                                     self.block_size, self.max_model_len, self.engine_config.max_num_seqs,
                                     self.config.hidden_size, self.dtype,
                                     head=self.model.lm_head if self.parallel is None else None)
        if not self.uses_graphs:
            return None
        from hybrid.graphs.decode_graphs import DecodeGraphs  # Triton: only engines that replay graphs need it

        pool = self.kv_pool
        return DecodeGraphs(self.model.model, pool.caches, self.attention, pool.pad_block, self.block_size,
                            self.max_model_len, self.engine_config.max_num_seqs, self.dtype, self.device,
                            lanes=2 if self.overlap else 1)

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

    def can_overlap(self, batch: list[ScheduledSeq]) -> bool:
        """Dual-batch overlap can run decode steps of two or more sequences with the experts out of process."""
        return self.overlap and len(batch) >= 2 and all(item.num_tokens == 1 for item in batch)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], rows: list[int] | None = None) -> torch.Tensor:
        """Logits [num sampling seqs, vocab] in the model's dtype (the sampler widens them where it needs fp32), or
        of `rows` (query rows of the batch, ascending) when given. A replayed program's logits are its own buffer,
        valid until the next step.
        Decode steps replay captured graphs unless the engine runs eagerly or the batch is too large; the
        overlap policy says which decode steps run split, and learns from their times in auto."""
        if rows is not None or not self.can_overlap(batch):
            return self._execute(batch, rows, split=False)
        context = sum(item.seq.num_computed_tokens + 1 for item in batch)
        split = self.overlap_policy.choose(len(batch), context)
        if not self.overlap_policy.learns:
            return self._execute(batch, rows, split)
        start = time.perf_counter()
        logits = self._execute(batch, rows, split)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.overlap_policy.record(len(batch), context, split, time.perf_counter() - start)
        return logits

    def _execute(self, batch: list[ScheduledSeq], rows: list[int] | None, split: bool) -> torch.Tensor:
        """The step, with the experts told what kind of pass it is; `step_streamed_bytes` is what it streamed."""
        before = self.experts.streamed_bytes
        longest = max((item.num_tokens for item in batch if prefilling(item.seq)), default=0)
        self.experts.begin_pass(sum(item.num_tokens for item in batch), longest)
        try:
            return self._run(batch, rows, split)
        finally:
            self.experts.end_pass()
            self.step_streamed_bytes = self.experts.streamed_bytes - before

    def _run(self, batch: list[ScheduledSeq], rows: list[int] | None, split: bool) -> torch.Tensor:
        if self.executor is not None:
            return self._execute_parallel(batch, rows)
        if split:
            half = len(batch) // 2
            a, b = self.host_batch(batch[:half]), self.host_batch(batch[half:])
            if self.graphs is not None and self.graphs.fits(a) and self.graphs.fits(b):
                hidden_a, hidden_b = self.graphs.run_overlapped(a, b)
            else:
                (ids_a, fb_a), (ids_b, fb_b) = (h.to_device(self.device, self.kv_pool.caches, self.attention)
                                                for h in (a, b))
                hidden_a, hidden_b = self.model.model.forward_overlapped(ids_a, fb_a, ids_b, fb_b)
            return self.model.compute_logits(torch.cat([hidden_a[a.sample_rows], hidden_b[b.sample_rows]]))
        host = self.host_batch(batch)
        out = None  # hidden states, or a replay's logits where the program ends with the lm_head
        if rows is None and self.graphs is not None and self.graphs.fits(host):
            out = self.graphs.run(host)
        logits = out is not None and self.graphs.gives_logits
        if out is None:
            input_ids, fb = host.to_device(self.device, self.kv_pool.caches, self.attention)
            out = self.model(input_ids, fb)
        rows = host.sample_rows if rows is None else rows
        if len(rows) < len(host.ids):  # rows are ascending: all of them, or a choice
            out = out[rows]
        return out if logits else self.model.compute_logits(out)

    def _execute_parallel(self, batch: list[ScheduledSeq], rows: list[int] | None) -> torch.Tensor:
        """The step on every rank: with pipeline stages, as one micro-batch per stage (of whole sequences)."""
        parts = min(self.engine_config.pp, len(batch))
        size = -(-len(batch) // parts)
        hosts = [self.host_batch(batch[i:i + size]) for i in range(0, len(batch), size)]
        hidden = self.executor.run(hosts)
        if rows is None:
            rows, offset = [], 0
            for host in hosts:
                rows.extend(offset + r for r in host.sample_rows)
                offset += len(host.ids)
        return self.model.compute_logits(hidden[rows])

    def follow(self) -> None:
        """A rank other than the driver: runs the driver's steps until it closes."""
        self.executor.follow()

    def close(self) -> None:
        """Stops the other ranks (driver; those of a broken run are killed) and releases the experts."""
        if self.parallel is not None:
            if self.parallel.state.info.driver and not self.executor.broken:
                try:
                    self.executor.stop()
                except CommunicationError:
                    self.executor.broken = True
            if self.executor.broken:
                log.warning("the parallel run is broken (a rank is gone or out of step): killing the other ranks")
                self.parallel.abort()
            else:
                self.parallel.close()
        self.experts.close()
