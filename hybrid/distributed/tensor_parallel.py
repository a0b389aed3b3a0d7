"""What a model's layers need to know to hold one rank's part: the tensor-parallel group (size, rank, all-reduce)
and which pipeline stage the rank is (its decoder layers, and whether it embeds, norms last or computes logits)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybrid.config.model_config import ConfigError
from hybrid.distributed.communicator import Communicator


@dataclass
class TensorParallel:
    size: int = 1
    rank: int = 0
    comm: Communicator | None = None

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's equal share of n units (heads, rows)."""
        if n % self.size:
            raise ConfigError(f"--tp {self.size} must divide the model's {n} {what}")
        count = n // self.size
        return self.rank * count, count

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial x (x itself without tensor parallelism)."""
        return x if self.size == 1 else self.comm.all_reduce(x.contiguous())


@dataclass(frozen=True)
class ModelShard:
    """The part of the model one rank holds. Pipeline stage 0 embeds; the last stage applies the final norm; only
    the driving rank (stage 0, tensor-parallel rank 0) holds lm_head."""

    tp: TensorParallel = field(default_factory=TensorParallel)
    layers: range | None = None
    embeds: bool = True
    final_norm: bool = True
    logits: bool = True

    def has_layer(self, i: int) -> bool:
        return self.layers is None or i in self.layers
