"""The elementwise ops between a decode step's weight-streaming kernels (csrc/elementwise.cpp): the residual add,
the dense MLP's silu(gate) * up, the widening of bf16 values to fp32, DeepSeek's router sigmoid, strided row copies
and row gathers (embedding and rotary rows), on the kernels' thread pool, and their torch references. Each rounds
as the torch ops it stands for."""

from __future__ import annotations

import torch

from cpu_kernels.moe import resolve_isa, runner

DTYPES = (torch.bfloat16, torch.float32)


def add(a: torch.Tensor, b: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """a + b for two bf16 or fp32 CPU tensors of one shape and dtype (the fp32 sum rounded, as torch adds)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype not in DTYPES or a.device.type != "cpu" \
            or b.device.type != "cpu":
        raise ValueError(f"add needs two bfloat16 or float32 CPU tensors of one shape, got {tuple(a.shape)} "
                         f"{a.dtype} and {tuple(b.shape)} {b.dtype}")
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty(a.shape, dtype=a.dtype)
    if a.numel():
        runner(num_threads).add(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(), a.dtype == torch.float32)
    return out


def add_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def silu_mul(gate: torch.Tensor, up: torch.Tensor, num_threads: int | None = None,
             isa: int | None = None) -> torch.Tensor:
    """silu(gate) * up for gate and up [rows, cols] (rows may be strided: the two halves of a fused gate/up
    projection), bf16 or fp32 -> [rows, cols] contiguous, silu rounded to the dtype before the product as
    F.silu(gate) * up rounds. silu's exp is the MoE kernels' vector exp, not torch's: a bf16 result may differ
    from the reference in the last bit."""
    if (gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in DTYPES
            or gate.device.type != "cpu" or up.device.type != "cpu"):
        raise ValueError(f"silu_mul needs gate and up [rows, cols] of one bfloat16 or float32 dtype on the CPU, "
                         f"got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    if gate.stride(1) != 1:
        gate = gate.contiguous()
    if up.stride(1) != 1:
        up = up.contiguous()
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=gate.dtype)
    if out.numel():
        runner(num_threads).silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
                                     rows, cols, gate.dtype == torch.float32, resolve_isa(isa))
    return out


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _map_to_fp32(kernel: str, x: torch.Tensor, dtype: torch.dtype, num_threads: int | None,
                 isa: int | None) -> torch.Tensor:
    """runner.<kernel> (x, out, n, isa) over a CPU tensor of `dtype` into a new contiguous fp32 tensor."""
    if x.dtype != dtype or x.device.type != "cpu":
        raise ValueError(f"{kernel} reads a {str(dtype).removeprefix('torch.')} CPU tensor, got {x.dtype} on "
                         f"{x.device}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    if x.numel():
        getattr(runner(num_threads), kernel)(x.data_ptr(), out.data_ptr(), x.numel(), resolve_isa(isa))
    return out


def widen(x: torch.Tensor, num_threads: int | None = None, isa: int | None = None) -> torch.Tensor:
    """A bf16 CPU tensor as fp32 (exact), contiguous."""
    return _map_to_fp32("widen", x, torch.bfloat16, num_threads, isa)


def widen_reference(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def sigmoid(x: torch.Tensor, num_threads: int | None = None, isa: int | None = None) -> torch.Tensor:
    """1 / (1 + exp(-x)) of an fp32 CPU tensor (the kernels' vector exp: within a few ulps of torch's)."""
    return _map_to_fp32("sigmoid", x, torch.float32, num_threads, isa)


def sigmoid_reference(x: torch.Tensor) -> torch.Tensor:
    return x.sigmoid()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for two CPU tensors of one shape and dtype whose last dimension is contiguous and whose
    leading dimensions flatten to equally spaced rows (e.g. q_rope into the last columns of MLA's query)."""
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.device.type != "cpu" or src.device.type != "cpu":
        raise ValueError(f"copy_into needs two CPU tensors of one shape and dtype, got {tuple(dst.shape)} "
                         f"{dst.dtype} and {tuple(src.shape)} {src.dtype}")
    width = src.shape[-1] if src.dim() else 1
    try:
        d, s = dst.view(-1, width), src.view(-1, width)
    except RuntimeError as e:
        raise ValueError(f"copy_into needs rows of {width} contiguous values: {e}") from e
    if d.stride(1) != 1 or s.stride(1) != 1:
        raise ValueError("copy_into needs the last dimension contiguous")
    if d.shape[0]:
        runner().copy_rows(s.data_ptr(), s.stride(0) * s.element_size(), d.data_ptr(), d.stride(0) * d.element_size(),
                           d.shape[0], width * d.element_size())


def gather_rows(table: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = table[index[i]] for a table of contiguous rows [N, ...], int64 indices [n] and out [n, ...] of the
    table's row shape and dtype (torch.index_select(table, 0, index, out=out)); an index outside [0, N) raises
    ValueError before anything is written. Recordable: a program replays it over the index's current values."""
    row = table.shape[1:]
    if (out.shape != (index.shape[0], *row) or out.dtype != table.dtype or index.dim() != 1
            or index.dtype != torch.int64 or {t.device.type for t in (table, index, out)} != {"cpu"}):
        raise ValueError(f"gather_rows needs out [{index.shape[0] if index.dim() == 1 else 'n'}, "
                         f"{', '.join(map(str, row))}] {table.dtype} and int64 indices [n] on the CPU, got out "
                         f"{tuple(out.shape)} {out.dtype} and indices {tuple(index.shape)} {index.dtype}")
    if not table[0].is_contiguous() or (index.shape[0] and not out[0].is_contiguous()) or not index.is_contiguous():
        raise ValueError("gather_rows needs contiguous rows and indices")
    if index.shape[0]:
        runner().gather_rows(table.data_ptr(), table.shape[0], table.stride(0) * table.element_size(),
                             index.data_ptr(), out.data_ptr(), out.stride(0) * out.element_size(), index.shape[0],
                             table[0].numel() * table.element_size())
    return out


def gather_rows_reference(table: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.index_select(table, 0, index, out=out)
