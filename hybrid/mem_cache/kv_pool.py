"""The paged KV cache of every layer as one object: it owns the cache tensors, and block b of each layer's
tensors holds the same tokens of the same sequence. The block manager hands out the block ids.

Shapes per layer come from the model (two [blocks, page, Hkv, D] tensors for GQA, one [blocks, page,
latent + rope] for MLA). `extra_blocks` are allocated past the usable ones and never handed out: the decode
graphs point their padding rows at the first of them. A pipeline stage holds only its own layers' caches
(`held_layers`; the others are empty tuples), with the same block ids as every other stage.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch


class KVPool:
    def __init__(self, token_shapes: list[tuple[int, ...]], num_layers: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, extra_blocks: int = 0,
                 held_layers: Collection[int] | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.caches: list[tuple[torch.Tensor, ...]] = [
            tuple(torch.zeros(num_blocks + extra_blocks, block_size, *shape, dtype=dtype, device=device)
                  for shape in token_shapes) if held_layers is None or i in held_layers else ()
            for i in range(num_layers)
        ]

    @staticmethod
    def bytes_per_token(token_shapes: list[tuple[int, ...]], num_layers: int, dtype: torch.dtype) -> int:
        """Cache bytes one token takes across every layer."""
        return sum(math.prod(s) for s in token_shapes) * dtype.itemsize * num_layers

    @property
    def pad_block(self) -> int:
        """The first block past the usable ones (valid only when the pool was made with extra_blocks)."""
        return self.num_blocks
