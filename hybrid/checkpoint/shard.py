"""The slice of a checkpoint tensor one tensor-parallel rank holds, and the fp8 block scales that go with it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """Rows (dim 0: a linear's outputs) or columns (dim 1: its inputs) [start, start + size) of a tensor whose
    full extent along `dim` is `full`."""

    dim: int
    start: int
    size: int
    full: int

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or self.size < 1 or self.start < 0 or self.start + self.size > self.full:
            raise ValueError(f"bad shard {self}")

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = self.full
        return tuple(shape)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(self.dim, self.start, self.size)

    def block_scales(self, scale_inv: torch.Tensor, block: int) -> torch.Tensor | None:
        """The rows / columns of an fp8 scale grid (one scale per `block` along `dim`) that this slice reads
        with the slice's own block grid: there is one where the slice starts on a block boundary, or lies inside
        one block. None otherwise (the caller dequantizes)."""
        first, last = self.start // block, (self.start + self.size - 1) // block
        if self.start % block and first != last:
            return None
        return scale_inv.narrow(self.dim, first, last - first + 1)
