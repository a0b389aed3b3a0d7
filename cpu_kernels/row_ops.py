"""The row conversions the MoE and linear kernels run around their dot products (csrc/row_ops.cpp), one row per
call on a chosen instruction set, and their torch references. For tests: the kernels call them internally."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpu_kernels import _C
from cpu_kernels.moe import resolve_isa
from cpu_kernels.pack import Format

ROWS = 16  # values per tile row


def _row(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if v.dim() != 1 or v.dtype != dtype or v.device.type != "cpu":
        raise ValueError(f"a row is a 1-d {dtype} CPU tensor, got {tuple(v.shape)} {v.dtype} on {v.device}")
    return v.contiguous()


def to_f32(src: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """src (bf16 or fp32) widened to fp32."""
    if src.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"to_f32 reads bf16 or fp32, got {src.dtype}")
    src = _row(src, src.dtype)
    out = torch.empty(src.numel(), dtype=torch.float32)
    _C.row_to_f32(resolve_isa(isa), src.data_ptr(), src.dtype == torch.float32, src.numel(), out.data_ptr())
    return out


def split_bf16(v: torch.Tensor, with_lo: bool = True,
               isa: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hi = bf16(v) and lo = bf16(v - hi) (round to nearest even, NaN kept quiet)."""
    v = _row(v, torch.float32)
    hi = torch.empty(v.numel(), dtype=torch.bfloat16)
    lo = torch.empty(v.numel(), dtype=torch.bfloat16) if with_lo else None
    _C.row_split_bf16(resolve_isa(isa), v.data_ptr(), v.numel(), hi.data_ptr(), lo.data_ptr() if with_lo else 0)
    return hi, lo


def split_bf16_reference(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = v.to(torch.bfloat16)
    return hi, (v - hi.float()).to(torch.bfloat16)


def put(hi: torch.Tensor, lo: torch.Tensor | None, scale: float, dtype: torch.dtype,
        isa: int | None = None) -> torch.Tensor:
    """(hi + lo) * scale as fp32, or rounded to bf16."""
    hi = _row(hi, torch.float32)
    if lo is not None:
        lo = _row(lo, torch.float32)
        if lo.numel() != hi.numel():
            raise ValueError(f"hi and lo differ in length: {hi.numel()} and {lo.numel()}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"put writes bf16 or fp32, got {dtype}")
    out = torch.empty(hi.numel(), dtype=dtype)
    _C.row_put(resolve_isa(isa), hi.data_ptr(), 0 if lo is None else lo.data_ptr(), hi.numel(), scale,
               dtype == torch.float32, out.data_ptr())
    return out


def put_reference(hi: torch.Tensor, lo: torch.Tensor | None, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return ((hi if lo is None else hi + lo) * torch.tensor(scale, dtype=torch.float32)).to(dtype)


def axpy_tiles(w: float, hi: torch.Tensor, lo: torch.Tensor | None, acc: torch.Tensor,
               isa: int | None = None) -> torch.Tensor:
    """acc + w * y for y held ROWS values per tile row: hi and lo are [tiles, stride] (the first ROWS values of
    each row used), y = hi + lo when lo is given; acc [n] with n <= tiles * ROWS."""
    if hi.dim() != 2 or hi.dtype != torch.float32 or hi.shape[1] < ROWS:
        raise ValueError(f"tiles are fp32 [tiles, >= {ROWS}], got {tuple(hi.shape)} {hi.dtype}")
    if lo is not None and (lo.shape != hi.shape or lo.dtype != torch.float32):
        raise ValueError(f"lo must match hi {tuple(hi.shape)}, got {tuple(lo.shape)} {lo.dtype}")
    acc = _row(acc, torch.float32).clone()
    if acc.numel() > hi.shape[0] * ROWS:
        raise ValueError(f"{acc.numel()} values do not fit {hi.shape[0]} tiles")
    hi = hi.contiguous()
    lo = None if lo is None else lo.contiguous()
    _C.row_axpy_tiles(resolve_isa(isa), w, hi.data_ptr(), 0 if lo is None else lo.data_ptr(), hi.shape[1], acc.numel(),
                      acc.data_ptr())
    return acc


def axpy_tiles_reference(w: float, hi: torch.Tensor, lo: torch.Tensor | None, acc: torch.Tensor) -> torch.Tensor:
    y = (hi if lo is None else hi + lo)[:, :ROWS].flatten()[:acc.numel()]
    return acc + torch.tensor(w, dtype=torch.float32) * y


def silu_mul(g: torch.Tensor, u: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """silu(g) * u for one tile row of ROWS fp32 values."""
    g, u = _row(g, torch.float32), _row(u, torch.float32)
    if g.numel() != ROWS or u.numel() != ROWS:
        raise ValueError(f"silu_mul takes {ROWS} values of g and u, got {g.numel()} and {u.numel()}")
    out = torch.empty(ROWS, dtype=torch.float32)
    _C.row_silu_mul(resolve_isa(isa), g.data_ptr(), u.data_ptr(), out.data_ptr())
    return out


def silu_mul_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g.double()).mul(u.double()).float()


def quantize_row(v: torch.Tensor, kp: int, fmt: Format, group: int,
                 isa: int | None = None) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Symmetric int8 quantization of v [k] zero-padded to kp: (codes as stored, int8 [kp]: q + 128 for the
    int8 format, q for int4; the scale; int4's sums of q per group of `group` columns, int32 [kp / group])."""
    v = _row(v, torch.float32)
    if fmt not in (Format.INT8, Format.INT4) or kp < v.numel() or kp % group:
        raise ValueError(f"quantize_row needs int8 / int4, kp >= {v.numel()} and a multiple of group {group}")
    q = torch.empty(kp, dtype=torch.int8)
    scale = torch.empty(1, dtype=torch.float32)
    gsum = torch.zeros(kp // group, dtype=torch.int32)
    _C.row_quantize(resolve_isa(isa), v.data_ptr(), v.numel(), kp, int(fmt), group, q.data_ptr(), scale.data_ptr(),
                    gsum.data_ptr())
    return q, float(scale), gsum


def quantize_row_reference(v: torch.Tensor, kp: int, fmt: Format,
                           group: int) -> tuple[torch.Tensor, float, torch.Tensor]:
    amax = v.abs().max() if v.numel() else torch.tensor(0.0)
    s = amax / 127 if amax > 0 else torch.tensor(1.0)
    inv = torch.tensor(1.0, dtype=torch.float32) / s
    x = torch.zeros(kp, dtype=torch.int32)
    x[:v.numel()] = torch.round((v * inv).clamp(-127, 127)).to(torch.int32)
    gsum = x.view(-1, group).sum(dim=1, dtype=torch.int32)
    if fmt != Format.INT4:
        gsum.zero_()
    q = (x + 128).to(torch.uint8).view(torch.int8) if fmt == Format.INT8 else x.to(torch.int8)
    return q, float(s), gsum
