"""Dense linear layers (y = x W^T) on the CPU kernels' thread pool, for CPU-only mode, and their reference; and
per-head linears (a matrix per attention head, MLA's absorbed projections)."""

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


class PackedHeads:
    """One matrix W_h [n, k] per head, packed in the kernel tile layout side by side: head h is the kernels'
    expert h of the packed matrices."""

    def __init__(self, matrices: list[PackedMatrix]):
        first = matrices[0]
        self.fmt, self.n, self.k, self.heads = first.fmt, first.n, first.k, len(matrices)
        self.block, self.group = first.block, first.group

        def stack(attr: str) -> torch.Tensor | None:
            parts = [getattr(m, attr) for m in matrices]
            return None if parts[0] is None else torch.stack(parts).contiguous()

        self.data, self.scales, self.comp, self.flags = (stack(a) for a in ("data", "scales", "comp", "flags"))
        ptr = lambda t: (0, 0) if t is None else (t.data_ptr(), t[0].numel())  # noqa: E731
        self.handle = _C.PackedMatrices(*ptr(self.data), *ptr(self.scales), *ptr(self.comp), *ptr(self.flags),
                                        first.tiles, first.kp)

    @classmethod
    def pack(cls, w: torch.Tensor, fmt: Format | str = "bf16") -> "PackedHeads":
        """w [heads, n, k]."""
        return cls([pack_matrix(w[h], fmt) for h in range(w.shape[0])])


def _head_rows(t: torch.Tensor, heads: int, width: int, what: str) -> tuple[int, int]:
    """(token, head) element strides of t [T, heads, width], whose rows must be contiguous."""
    if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != width or (t.stride(2) != 1 and width > 1):
        raise ValueError(f"{what} must be [tokens, {heads}, {width}] with contiguous rows, got {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.stride(0), t.stride(1)


def head_linear(p: PackedHeads, x: torch.Tensor, out: torch.Tensor | None = None,
                num_threads: int | None = None, isa: int | None = None) -> torch.Tensor:
    """out[t, h] = W_h x[t, h]: x [T, heads, k] bf16 or fp32 (rows may be strided, e.g. q's nope columns) ->
    [T, heads, n] in x's dtype, written into `out` when given (a view whose rows may be strided, e.g. the
    first columns of a wider buffer)."""
    if x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu":
        raise ValueError(f"head_linear needs bfloat16 or float32 CPU inputs, got {x.dtype} on {x.device}")
    x_strides = _head_rows(x, p.heads, p.k, "head_linear's input")
    if out is None:
        out = torch.empty(x.shape[0], p.heads, p.n, dtype=x.dtype)
    elif out.dtype != x.dtype or out.shape[0] != x.shape[0]:
        raise ValueError(f"head_linear's output must be {x.dtype} with {x.shape[0]} tokens, got "
                         f"{tuple(out.shape)} {out.dtype}")
    out_strides = _head_rows(out, p.heads, p.n, "head_linear's output")
    if x.shape[0]:
        runner(num_threads).head_linear(int(p.fmt), p.handle, p.heads, p.n, p.k, p.block[1], p.group, x.data_ptr(),
                                        *x_strides, x.dtype == torch.float32, x.shape[0], out.data_ptr(),
                                        *out_strides, resolve_isa(isa))
    return out


def head_linear_reference(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """fp32 torch: w [heads, n, k], x [T, heads, k] -> [T, heads, n]."""
    return torch.einsum("thk,hnk->thn", x.float(), w.float()).to(x.dtype)
