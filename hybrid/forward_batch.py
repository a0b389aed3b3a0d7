"""What one model step needs to know about the batch: token positions, KV slots and per-sequence spans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardBatch:
    """Tokens of all scheduled sequences are flattened into one [N] axis.

    Sequence i owns query rows query_starts[i] : query_starts[i] + query_lens[i]; after this step its
    KV cache holds context_lens[i] tokens, reachable through block_tables[i].
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]
    kv_caches: list[tuple[torch.Tensor, ...]]
    attention: Any = None  # a gpu.triton_attention.TritonAttention in the hybrid runner; None: the torch path

    def __post_init__(self) -> None:
        n = len(self.query_lens)
        if not (len(self.query_starts) == len(self.context_lens) == len(self.block_tables) == n):
            raise ValueError("per-sequence lists of a ForwardBatch must have the same length")
        if any(q > c for q, c in zip(self.query_lens, self.context_lens)):
            raise ValueError("a sequence cannot have more query tokens than context tokens")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)
