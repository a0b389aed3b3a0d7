"""The CPU runner's attention backend: decode rows through the C++ paged decode kernel, the rest in torch.

Sequences with one query token this step (decode) go to cpu_kernels.attention in one call; prefill and
extend chunks keep the torch path (hybrid.attention), which batches their rows as matrix products.
DeepSeek's MLA prefill stays in the expanded form, cheaper than latent space on the CPU.
"""

from __future__ import annotations

import torch

from cpu_kernels.attention import decode_attention
from hybrid.attention import paged_attention, write_cache
from hybrid.forward_batch import ForwardBatch


class CpuAttention:
    latent_prefill = False

    def __init__(self, num_threads: int | None = None):
        self.num_threads = num_threads

    def store(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        write_cache(cache, slot_mapping, values)

    def gqa(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
            scale: float) -> torch.Tensor:
        """q [N, Hq, D] over caches [blocks, page, Hkv, D|Dv] -> [N, Hq, Dv]."""
        decode = [i for i, n in enumerate(batch.query_lens) if n == 1]
        rest = [i for i, n in enumerate(batch.query_lens) if n != 1]
        pick = lambda xs, idx: [xs[i] for i in idx]  # noqa: E731
        if rest:
            out = paged_attention(q, k_cache, v_cache, pick(batch.query_starts, rest), pick(batch.query_lens, rest),
                                  pick(batch.context_lens, rest), pick(batch.block_tables, rest), scale)
        else:
            out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
        if decode:
            tables, lens = batch.padded_tables()
            rows = torch.tensor(pick(batch.query_starts, decode))
            sel = torch.tensor(decode)
            out[rows] = decode_attention(q[rows], k_cache, v_cache, tables[sel], lens[sel], scale, self.num_threads)
        return out

    def mla(self, q: torch.Tensor, cache: torch.Tensor, lora: int, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q [N, H, lora + rope] (nope part already absorbed) over the [latent | rope] cache -> [N, H, lora]."""
        return self.gqa(q, cache.unsqueeze(2), cache[..., :lora].unsqueeze(2), batch, scale)
