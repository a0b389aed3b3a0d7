"""Packing expert weights into the kernels' tile layouts (see csrc/moe.h), and unpacking them back.

Every packed matrix is a W [N, K] split into tiles of 16 rows with K zero-padded to `kp`:
bf16 lines of one k pair, fp8 lines of two k pairs (pre-shuffled for the in-register conversion),
int8 lines of four k, int4 lines of eight k with each group's scales inline. `unpack_matrix` is the
exact inverse up to quantization and is what the pure-torch reference computes with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch

from cpu_kernels import _C

ROWS = 16
FP8_MAX = 448.0
# int4 scale group along K: 128 columns (as GPTQ/AWQ checkpoints) keeps scales at 0.25 bit per weight and lets
# the AMX kernel run two full 64-column k steps per dequantizing epilogue; any multiple of 16 still packs.
INT4_GROUP = 128


class Format(IntEnum):
    BF16 = 0
    FP8 = 1
    INT8 = 2
    INT4 = 3

    @classmethod
    def parse(cls, name: str | Format) -> Format:
        if isinstance(name, Format):
            return name
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown expert format {name!r}; choose bf16, fp8, int8 or int4") from None


@dataclass
class PackedMatrix:
    """One W [n, k] in tiles: data [tiles, tile_bytes] uint8, scales [tiles, ...] fp32, comp [tiles, 16] int32,
    flags [tiles, ceil(kp / 64)] uint8 (fp8: which line pairs hold codes the fast conversion gets wrong)."""

    fmt: Format
    n: int
    k: int
    kp: int
    data: torch.Tensor
    scales: torch.Tensor | None = None
    comp: torch.Tensor | None = None
    flags: torch.Tensor | None = None
    block: tuple[int, int] = (128, 128)
    group: int = INT4_GROUP

    @property
    def tiles(self) -> int:
        return self.data.shape[0]


def check_int4_group(group: int) -> None:
    # A multiple of 16 keeps a padded K a whole number of the 16-column activation lines the kernels write.
    if group < 16 or group % 16:
        raise ValueError(f"int4 group must be a positive multiple of 16, got {group}")


def padded_k(fmt: Format, k: int, block_k: int = 128, group: int = INT4_GROUP) -> int:
    # bf16 32 and int8 64: one AMX k step (64 bytes of an activation row)
    step = {Format.BF16: 32, Format.FP8: block_k, Format.INT8: 64, Format.INT4: group}[fmt]
    return math.ceil(k / step) * step


def tile_bytes(fmt: Format, kp: int, group: int = INT4_GROUP) -> int:
    """Bytes of one packed tile (16 rows x kp columns); int4 adds one 64-byte scale line per group."""
    if fmt == Format.INT4:
        return kp * ROWS // 2 + kp // group * 64
    return kp * ROWS * (2 if fmt == Format.BF16 else 1)


def packed_bytes(fmt: Format | str, n: int, k: int, block_k: int = 128, group: int = INT4_GROUP) -> int:
    """Bytes pack_matrix gives W [n, k] in `fmt` (data, scales, compensation, flags), without packing it."""
    fmt = Format.parse(fmt)
    kp = padded_k(fmt, k, block_k=block_k, group=group)
    tiles = math.ceil(n / ROWS)
    extra = {Format.FP8: kp // block_k * 4 + fp8_flag_bytes(kp), Format.INT8: 2 * ROWS * 4}.get(fmt, 0)
    return tiles * (tile_bytes(fmt, kp, group) + extra)


def fp8_flag_bytes(kp: int) -> int:
    """Bytes of one fp8 tile's line pair flags: one bit per 8 columns."""
    return -(-kp // 64)


def _pad(w: torch.Tensor, n: int, k: int) -> torch.Tensor:
    out = torch.zeros(n, k, dtype=w.dtype)
    out[: w.shape[0], : w.shape[1]] = w
    return out


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization: w ~= fp8 * scale_inv, one scale per block, partial edge blocks allowed."""
    rows, cols = w.shape
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    blocks = _pad(w.float(), nr * br, nc * bc).view(nr, br, nc, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), scale


def tile_lines(w: torch.Tensor, kp: int, fmt: Format) -> torch.Tensor:
    """W [n, k] (bf16, fp8 or int8 codes) -> its tiles' lines [tiles, 16 * kp * itemsize] uint8, rows and
    columns zero-padded: one pass in C++, the same bytes as `tile_lines_reference`."""
    if fmt not in (Format.BF16, Format.FP8, Format.INT8):
        raise ValueError(f"{fmt.name} tiles are not plain line shuffles")
    n, k = w.shape
    if w.stride(1) != 1:
        w = w.contiguous()
    item = w.element_size()
    tiles = math.ceil(n / ROWS)
    out = torch.empty(tiles, ROWS * kp * item, dtype=torch.uint8)
    if tiles:
        _C.pack_tile_lines(int(fmt == Format.FP8), w.data_ptr(), w.stride(0) * item, n, k * item, kp * item,
                           out.data_ptr())
    return out


def fp8_pair_flags(lines: torch.Tensor, kp: int) -> torch.Tensor:
    """fp8 tile lines [tiles, 16 * kp] -> their line pair flags [tiles, ceil(kp / 64)] uint8 (csrc/moe.h)."""
    flags = torch.empty(lines.shape[0], fp8_flag_bytes(kp), dtype=torch.uint8)
    _C.fp8_pair_flags(lines.data_ptr(), lines.shape[0], kp, flags.data_ptr())
    return flags


def fp8_pair_flags_reference(lines: torch.Tensor, kp: int) -> torch.Tensor:
    """`fp8_pair_flags` in torch: bit p % 8 of byte p / 8 is set where pair p's 128 codes hold a zero,
    subnormal, tiny (e = 1, m < 7) or NaN code."""
    tiles, pairs = lines.shape[0], kp // 8
    odd = (((lines.view(tiles, pairs, 128).int() + 1) & 0x70) == 0).any(dim=2)
    bits = torch.zeros(tiles, -(-pairs // 8) * 8, dtype=torch.int32)
    bits[:, :pairs] = odd.int()
    return (bits.view(tiles, -1, 8) << torch.arange(8)).sum(dim=2).to(torch.uint8)


def tile_lines_reference(w: torch.Tensor, kp: int, fmt: Format) -> torch.Tensor:
    """`tile_lines` in torch permutations."""
    n = w.shape[0]
    tiles = math.ceil(n / ROWS)
    q = _pad(w, tiles * ROWS, kp)
    if fmt == Format.FP8:
        # rows r = 4 * lane + ri, k = 4 * c + 2 * h + j  ->  byte 16 * lane + 8 * h + 2 * ri + j of line c
        return q.view(torch.uint8).view(tiles, 4, 4, kp // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(tiles, -1)
    per_line = 2 if fmt == Format.BF16 else 4
    lines = q.view(tiles, ROWS, kp // per_line, per_line).permute(0, 2, 1, 3).contiguous()
    return lines.view(torch.uint8).reshape(tiles, -1)


def pack_matrix(w: torch.Tensor, fmt: Format | str, *, scale_inv: torch.Tensor | None = None,
                block: tuple[int, int] = (128, 128), group: int = INT4_GROUP) -> PackedMatrix:
    """Packs W [n, k]. For fp8, `w` may already be float8_e4m3fn with its `scale_inv` block grid (used as is);
    otherwise it is quantized. int8 uses per-row scales, int4 symmetric scales per `group` columns."""
    fmt = Format.parse(fmt)
    n, k = w.shape
    tiles = math.ceil(n / ROWS)
    np_ = tiles * ROWS
    if fmt == Format.FP8:
        if block[0] % ROWS or block[1] % ROWS or min(block) <= 0:
            raise ValueError(f"fp8 block {block} must be a positive multiple of 16 rows and 16 columns")
        if w.dtype != torch.float8_e4m3fn:
            w, scale_inv = quantize_fp8_blocks(w, block)
        elif scale_inv is None:
            raise ValueError("fp8 weights need their scale_inv block grid")
        kp = padded_k(fmt, k, block_k=block[1])
        row_block = (torch.arange(tiles) * ROWS) // block[0]
        scales = scale_inv.float()[row_block].contiguous()
        lines = tile_lines(w, kp, fmt)
        return PackedMatrix(fmt, n, k, kp, lines, scales, flags=fp8_pair_flags(lines, kp), block=block)
    if fmt == Format.INT4:
        check_int4_group(group)
    kp = padded_k(fmt, k, group=group)
    if fmt == Format.BF16:
        return PackedMatrix(fmt, n, k, kp, tile_lines(w.to(torch.bfloat16), kp, fmt))
    wf = _pad(w.float(), np_, kp)
    if fmt == Format.INT8:
        scale = wf.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
        comp = (128 * q.to(torch.int32).sum(dim=1)).to(torch.int32).view(tiles, ROWS)
        return PackedMatrix(fmt, n, k, kp, tile_lines(q, kp, fmt), scale.view(tiles, ROWS).contiguous(),
                            comp.contiguous())
    groups = kp // group
    g = wf.view(np_, groups, group)
    scale = g.abs().amax(dim=2) / 7.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = (torch.round(g / scale[:, :, None]).clamp(-8, 7) + 8).to(torch.uint8).view(np_, kp // 8, 2, 4)
    byte = u[:, :, 0, :] | (u[:, :, 1, :] << 4)
    lines = byte.view(tiles, ROWS, groups, group // 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, -1)
    scale_line = scale.view(tiles, ROWS, groups).permute(0, 2, 1).contiguous().view(torch.uint8)
    data = torch.cat([lines, scale_line], dim=2).reshape(tiles, -1)
    return PackedMatrix(fmt, n, k, kp, data.contiguous(), group=group)


def unpack_matrix(p: PackedMatrix) -> torch.Tensor:
    """The float32 W [n, k] the kernels compute with (dequantized)."""
    tiles, kp = p.tiles, p.kp
    if p.fmt == Format.BF16:
        w = p.data.view(torch.int16).view(tiles, kp // 2, ROWS, 2).permute(0, 2, 1, 3).reshape(tiles * ROWS, kp)
        w = w.view(torch.bfloat16).float()
    elif p.fmt == Format.FP8:
        q = p.data.view(tiles, kp // 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(tiles * ROWS, kp)
        scale = p.scales.repeat_interleave(p.block[1], dim=1)[:, :kp].repeat_interleave(ROWS, dim=0)
        w = q.view(torch.float8_e4m3fn).float() * scale
    elif p.fmt == Format.INT8:
        q = p.data.view(torch.int8).view(tiles, kp // 4, ROWS, 4).permute(0, 2, 1, 3).reshape(tiles * ROWS, kp)
        w = q.float() * p.scales.reshape(-1, 1)
    else:
        groups, chunks = kp // p.group, p.group // 8
        per_group = p.data.view(tiles, groups, chunks + 1, 64)
        b = per_group[:, :, :chunks].reshape(tiles, kp // 8, ROWS, 4).permute(0, 2, 1, 3)
        u = torch.stack([b & 0xF, b >> 4], dim=3).reshape(tiles * ROWS, kp)
        scale = per_group[:, :, chunks].contiguous().view(torch.float32)  # [tiles, groups, 16]
        scale = scale.permute(0, 2, 1).reshape(tiles * ROWS, groups).repeat_interleave(p.group, dim=1)
        w = (u.float() - 8) * scale
    return w[: p.n, : p.k].contiguous()
