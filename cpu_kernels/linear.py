"""Dense linear layers (y = x W^T) on the CPU kernels' thread pool, for CPU-only mode, and their reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpu_kernels import _C
from cpu_kernels.moe import resolve_isa, runner
from cpu_kernels.pack import INT4_GROUP, Format, PackedMatrix, pack_matrix, unpack_matrix


class PackedLinear:
    """One weight [n, k] packed in the kernel tile layout (bf16, fp8 with block scales, int8 or int4)."""

    def __init__(self, matrix: PackedMatrix):
        self.matrix = matrix
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        self.handle = _C.PackedMatrices(matrix.data.data_ptr(), 0, ptr(matrix.scales), 0, ptr(matrix.comp), 0,
                                        ptr(matrix.flags), 0, matrix.tiles, matrix.kp)

    @classmethod
    def pack(cls, w: torch.Tensor, fmt: Format | str, scale_inv: torch.Tensor | None = None,
             block: tuple[int, int] = (128, 128), group: int = INT4_GROUP) -> "PackedLinear":
        return cls(pack_matrix(w, fmt, scale_inv=scale_inv, block=block, group=group))

    @property
    def out_features(self) -> int:
        return self.matrix.n

    @property
    def in_features(self) -> int:
        return self.matrix.k

    def nbytes(self) -> int:
        m = self.matrix
        return sum(t.numel() * t.element_size() for t in (m.data, m.scales, m.comp, m.flags) if t is not None)


def linear(p: PackedLinear, x: torch.Tensor, num_threads: int | None = None, isa: int | None = None) -> torch.Tensor:
    """x [..., k] bf16 or fp32 -> [..., n] in the same dtype (fp32 inputs keep fp32 accuracy for bf16/fp8)."""
    m = p.matrix
    if x.shape[-1] != m.k:
        raise ValueError(f"linear expects inputs with {m.k} features, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu":
        raise ValueError(f"linear needs bfloat16 or float32 CPU inputs, got {x.dtype} on {x.device}")
    flat = x.reshape(-1, m.k).contiguous()
    out = torch.empty(flat.shape[0], m.n, dtype=x.dtype)
    if flat.shape[0]:
        runner(num_threads).linear(int(m.fmt), p.handle, m.n, m.k, m.block[1], m.group, flat.data_ptr(),
                                   x.dtype == torch.float32, flat.shape[0], out.data_ptr(),
                                   resolve_isa(isa))
    return out.view(*x.shape[:-1], m.n)


def linear_reference(p: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """fp32 torch reference over the dequantized weight."""
    return F.linear(x.float(), unpack_matrix(p.matrix)).to(x.dtype)
