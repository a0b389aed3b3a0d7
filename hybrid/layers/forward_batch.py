"""What one model step needs to know about the batch: token positions, KV slots and per-sequence spans."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hybrid.layers.attention.backend import AttentionBackend


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
    attention: AttentionBackend
    decode_splits: int | None = None  # fixed split-KV count for decode (graphs); None: from the longest context
    # Values the layers derive from the batch, computed once per step (derived); None for the static batches
    # of captured graphs, whose inputs are rewritten before every replay.
    memo: dict | None = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.query_lens)
        if not (len(self.query_starts) == len(self.context_lens) == len(self.block_tables) == n):
            raise ValueError("per-sequence lists of a ForwardBatch must have the same length")
        if any(q > c for q, c in zip(self.query_lens, self.context_lens)):
            raise ValueError("a sequence cannot have more query tokens than context tokens")
        if self.query_starts != list(accumulate(self.query_lens[:-1], initial=0))[:n]:
            raise ValueError("each sequence's query rows must follow the previous sequence's")

    @classmethod
    def static_decode(cls, positions: torch.Tensor, slot_mapping: torch.Tensor, tables: torch.Tensor,
                      context_lens: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                      attention: AttentionBackend, decode_splits: int | None) -> "ForwardBatch":
        """A decode step of len(positions) sequences whose per-sequence values live only in device tensors,
        rewritten before every graph replay. Its host-side context lengths and block tables are
        placeholders: the attention backend reads the padded tensors, never the lists."""
        n = positions.shape[0]
        batch = cls(positions, slot_mapping, list(range(n)), [1] * n, [1] * n, list(tables), kv_caches, attention,
                    decode_splits)
        batch.padded_tables = (tables, context_lens)  # fills the cached property with the static tensors
        batch.memo = None
        return batch

    def derived(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """make(), shared by every layer of this step under `key` (made again each time for static batches)."""
        if self.memo is None:
            return make()
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @cached_property
    def padded_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables padded to [num_seqs, max blocks] int32 and context lengths int32, built once per step."""
        dev = self.positions.device
        width = max(len(t) for t in self.block_tables)
        tables = torch.zeros(self.num_seqs, width, dtype=torch.int32, device=dev)
        for i, t in enumerate(self.block_tables):
            tables[i, :len(t)] = t
        return tables, torch.tensor(self.context_lens, dtype=torch.int32, device=dev)

    @cached_property
    def query_lens_tensor(self) -> torch.Tensor:
        """Query lengths int32 (CPU), built once per step."""
        return torch.tensor(self.query_lens, dtype=torch.int32)


@dataclass
class HostBatch:
    """One step's inputs as host lists, before they become device tensors: the flattened token ids,
    positions and KV slots, the per-sequence spans and block tables, and the rows whose logits are sampled."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    def write_static(self, io: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor, pad_block: int) -> None:
        """A decode step into the first rows of the static inputs a replayed step reads: ids, positions and slots
        into io [3, size], block tables padded with pad_block into tables, context lengths into context_lens."""
        n = len(self.ids)
        width = max(len(t) for t in self.block_tables)
        if io.device.type == "cpu":  # through numpy views: a tenth of the torch calls' time, every CPU decode step
            io_, tables_ = io.numpy(), tables.numpy()
            io_[0, :n], io_[1, :n], io_[2, :n] = self.ids, self.positions, self.slots
            for row, t in zip(tables_, self.block_tables):
                row[:len(t)] = t
                row[len(t):width] = pad_block
            context_lens.numpy()[:n] = self.context_lens
            return
        io[:, :n].copy_(torch.tensor([self.ids, self.positions, self.slots], dtype=torch.long))
        rows = [t + [pad_block] * (width - len(t)) for t in self.block_tables]
        tables[:n, :width].copy_(torch.tensor(rows, dtype=torch.int32))
        context_lens[:n].copy_(torch.tensor(self.context_lens, dtype=torch.int32))

    def to_device(self, device: torch.device, kv_caches: list[tuple[torch.Tensor, ...]],
                  attention: AttentionBackend) -> tuple[torch.Tensor, ForwardBatch]:
        """Input ids and the ForwardBatch on `device`."""
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        tables = [as_tensor(t) for t in self.block_tables]
        return as_tensor(self.ids), ForwardBatch(as_tensor(self.positions), as_tensor(self.slots),
                                                 self.query_starts, self.query_lens, self.context_lens, tables,
                                                 kv_caches, attention)

