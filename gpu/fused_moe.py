"""Fused MoE on the device over experts in the pack's tile layout (streamed prefill): gate/up with SiLU, then down,
weighted by the router, for one layer's tokens grouped by expert.

The weights are the packed expert file's bytes, copied as they are (cpu_kernels/pack.py documents the layout):
a matrix W [n, k] is tiles of 16 rows, each tile a run of 64-byte lines, so a tile of 16 rows over all of K is
contiguous and a [16, BLOCK_K] piece is 16 * BLOCK_K contiguous bytes -- loads coalesce as well as from a
row-major W. w13 interleaves gate and up tiles (tile 2t: gate rows 16t.., 2t + 1: up rows 16t..). Formats:
bf16; fp8 e4m3 with one scale per 16-row tile and `block_k` columns (DeepSeek's 128x128 blocks), decoded to
bf16 exactly in registers and scaled per k step; int8 with per-row scales; int4 with per-group scales inline.

Two launches: (1) per block of BLOCK_M (token, expert) pairs of one expert and BLOCK_N intermediate features,
silu(x W_gate^T) * (x W_up^T) into an intermediate buffer; (2) per block and BLOCK_N hidden features,
inter W_down^T times the routing weight into one output row per pair, summed over top-k afterwards (no atomics,
so results do not depend on scheduling). Grouping runs on the device with a fixed upper bound on blocks: no host
synchronization.

Each block streams its expert's weights for all of K, so an expert's weights are read (and fp8 / int codes decoded)
once per block of its pairs: the block is as tall as the pairs an expert gets on average allow (`tile_shape`).
On an H100, 16 x 32 blocks over a DeepSeek-V3 layer at 8192 tokens (256 pairs per expert: every weight read 16
times) ran at 23.6 TFLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu.decode_attention import upcast_dots

BF16, FP8, INT8, INT4 = 0, 1, 2, 3  # cpu_kernels.pack.Format values
ROWS = 16
LINE = 64
# A compiled kernel may read a module global only if it is a constexpr (the interpreter, which runs the CPU tests,
# does not check: tests/test_triton_globals.py does).
_ROWS, _LINE = tl.constexpr(ROWS), tl.constexpr(LINE)


@dataclass
class DeviceExperts:
    """One layer's packed experts on the device (or a subset of them: `slot` maps expert id -> index here, -1
    for experts not present). data [E', tiles, tile_bytes] uint8; scales per tile as the pack holds them (fp8
    [E', tiles, kp / block_k], int8 [E', tiles, 16]; None for bf16 and int4, whose scales are inline)."""

    fmt: int
    hidden: int
    inter: int
    kp13: int
    kp2: int
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scales: torch.Tensor | None
    w2_scales: torch.Tensor | None
    slot: torch.Tensor
    block_k: int = 128
    group: int = 128

    def __post_init__(self) -> None:
        if self.fmt not in (BF16, FP8, INT8, INT4):
            raise ValueError(f"unknown packed format {self.fmt}")
        if self.fmt in (FP8, INT8) and (self.w13_scales is None or self.w2_scales is None):
            raise ValueError("fp8 and int8 experts need their scales")


@triton.jit
def _fp8_to_float(code):
    """e4m3fn code (int32 0..255) -> float32, exact: normals by building the fp32 bits, subnormals as m * 2^-9,
    0x7f / 0xff NaN."""
    sign = code & 0x80
    e = (code >> 3) & 0xF
    m = code & 0x7
    bits = (sign << 24) | ((e + 120) << 23) | (m << 20)
    normal = bits.to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    sub = tl.where(sign != 0, -sub, sub)
    value = tl.where(e == 0, sub, normal)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _weight_tile(data, scales, e, n, k0, k, n_mask, TILE: tl.constexpr, FMT: tl.constexpr, BLOCK_K_SCALE: tl.constexpr,
                 GROUP: tl.constexpr, TILES, SCALE_COLS):
    """W[n, k] for n [BLOCK_N] packed row numbers and k = k0 + [0, BLOCK_K) columns, as float32 [BLOCK_K, BLOCK_N],
    and the per-column factor of this k step (1 where the format scales at the end)."""
    tile = n // _ROWS
    r = n % _ROWS
    base = (e * TILES + tile).to(tl.int64) * TILE
    kk = k[:, None]
    rr = r[None, :]
    mask = n_mask[None, :]
    if FMT == 0:
        off = base[None, :] + (kk // 2) * 32 + rr * 2 + kk % 2
        w = tl.load(data + off, mask=mask, other=0.0).to(tl.float32)
        s = tl.full(n.shape, 1.0, tl.float32)
    elif FMT == 1:
        off = base[None, :] + (kk // 4) * _LINE + (rr // 4) * 16 + ((kk // 2) % 2) * 8 + (rr % 4) * 2 + kk % 2
        w = _fp8_to_float(tl.load(data + off, mask=mask, other=0).to(tl.int32))
        s = tl.load(scales + (e * TILES + tile).to(tl.int64) * SCALE_COLS + k0 // BLOCK_K_SCALE, mask=n_mask,
                    other=0.0)
    elif FMT == 2:
        off = base[None, :] + (kk // 4) * _LINE + rr * 4 + kk % 4
        w = tl.load(data + off, mask=mask, other=0).to(tl.float32)
        s = tl.full(n.shape, 1.0, tl.float32)
    else:
        chunks: tl.constexpr = GROUP // 8
        g = kk // GROUP
        within = kk % GROUP
        off = base[None, :] + g * ((chunks + 1) * _LINE) + (within // 8) * _LINE + rr * 4 + within % 4
        byte = tl.load(data + off, mask=mask, other=0x88).to(tl.int32)
        nibble = (byte >> (((within % 8) // 4) * 4)) & 0xF
        w = (nibble - 8).to(tl.float32)
        scale_byte = base + (k0 // GROUP) * ((chunks + 1) * _LINE) + chunks * _LINE + r * 4
        s = tl.load(scales + scale_byte // 4, mask=n_mask, other=0.0)
    return w, s


@triton.jit
def _block(block_rows, block_expert, slot, pid_m, num_rows, BLOCK_M: tl.constexpr):
    """Block pid_m's expert id (-1: an unused block), its place in the buffer, its pair rows and which are live."""
    expert = tl.load(block_expert + pid_m)
    e = tl.load(slot + tl.maximum(expert, 0))
    rows = tl.load(block_rows + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, e, rows, (rows >= 0) & (rows < num_rows)


@triton.jit
def _gate_up_kernel(x, block_rows, block_expert, slot, data, scales, inter, s_x, s_i, num_rows, H, INTER, KP, TILES,
                    SCALE_COLS, TOPK: tl.constexpr, FMT: tl.constexpr, TILE: tl.constexpr,
                    BLOCK_K_SCALE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, e, rows, live = _block(block_rows, block_expert, slot, pid_m, num_rows, BLOCK_M)
    if expert < 0:
        return
    tok = tl.where(live, rows // TOPK, 0).to(tl.int64)
    f = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    f_mask = f < INTER
    gate_n = (f // _ROWS) * 2 * _ROWS + f % _ROWS  # packed row of gate feature f; its up row is 16 further
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x + tok[:, None] * s_x + k[None, :], mask=live[:, None] & (k[None, :] < H), other=0.0)
        wg, sg = _weight_tile(data, scales, e, gate_n, k0, k, f_mask, TILE, FMT, BLOCK_K_SCALE, GROUP, TILES,
                              SCALE_COLS)
        wu, su = _weight_tile(data, scales, e, gate_n + _ROWS, k0, k, f_mask, TILE, FMT, BLOCK_K_SCALE, GROUP,
                              TILES, SCALE_COLS)
        if UPCAST:
            xd = xv.to(tl.float32)
            acc_g += tl.dot(xd, wg, input_precision="ieee") * sg[None, :]
            acc_u += tl.dot(xd, wu, input_precision="ieee") * su[None, :]
        else:
            xd = xv.to(tl.bfloat16)
            acc_g += tl.dot(xd, wg.to(tl.bfloat16)) * sg[None, :]
            acc_u += tl.dot(xd, wu.to(tl.bfloat16)) * su[None, :]
    if FMT == 2:
        acc_g *= tl.load(scales + (e * TILES + gate_n // _ROWS).to(tl.int64) * SCALE_COLS + gate_n % _ROWS,
                         mask=f_mask, other=0.0)[None, :]
        acc_u *= tl.load(scales + (e * TILES + gate_n // _ROWS + 1).to(tl.int64) * SCALE_COLS + gate_n % _ROWS,
                         mask=f_mask, other=0.0)[None, :]
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    tl.store(inter + out_rows[:, None] * s_i + f[None, :], h.to(inter.dtype.element_ty),
             mask=live[:, None] & f_mask[None, :])


@triton.jit
def _down_kernel(inter, block_rows, block_expert, slot, data, scales, topk_weights, out, s_i, s_o, num_rows, H, INTER,
                 KP, TILES, SCALE_COLS, FMT: tl.constexpr, TILE: tl.constexpr, BLOCK_K_SCALE: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, e, rows, live = _block(block_rows, block_expert, slot, pid_m, num_rows, BLOCK_M)
    if expert < 0:
        return
    in_rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < H
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        hv = tl.load(inter + in_rows[:, None] * s_i + k[None, :], mask=live[:, None] & (k[None, :] < INTER), other=0.0)
        w, s = _weight_tile(data, scales, e, n, k0, k, n_mask, TILE, FMT, BLOCK_K_SCALE, GROUP, TILES, SCALE_COLS)
        if UPCAST:
            acc += tl.dot(hv.to(tl.float32), w, input_precision="ieee") * s[None, :]
        else:
            acc += tl.dot(hv.to(tl.bfloat16), w.to(tl.bfloat16)) * s[None, :]
    if FMT == 2:
        acc *= tl.load(scales + (e * TILES + n // _ROWS).to(tl.int64) * SCALE_COLS + n % _ROWS, mask=n_mask,
                       other=0.0)[None, :]
    weight = tl.load(topk_weights + tl.where(live, rows, 0), mask=live, other=0.0).to(tl.float32)
    acc *= weight[:, None]
    safe = tl.where(live, rows, 0).to(tl.int64)
    tl.store(out + safe[:, None] * s_o + n[None, :], acc, mask=live[:, None] & n_mask[None, :])


def group_by_expert(topk_ids: torch.Tensor, slot: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_rows [blocks * block_m] int32: flat (token, k) pair index or -1, block_expert [blocks] int32: expert
    id or -1), pairs of one expert in consecutive blocks of block_m. Pairs whose id is negative or whose expert is
    absent (slot -1) are left out. `blocks` is an upper bound known without reading the ids back to the host."""
    ids = topk_ids.flatten().long()
    pairs = ids.numel()
    num_experts = slot.numel()
    present = (ids >= 0) & (slot[ids.clamp(min=0)] >= 0)
    key = torch.where(present, ids, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    blocks = -(-pairs // block_m) + num_experts
    sorted_key = key[order]
    keep = sorted_key < num_experts
    e_sorted = sorted_key.clamp(max=num_experts - 1)
    pos = starts[e_sorted] + torch.arange(pairs, device=ids.device) - first[e_sorted]
    block_rows = torch.full((blocks * block_m + block_m,), -1, dtype=torch.int32, device=ids.device)
    block_rows[torch.where(keep, pos, blocks * block_m)] = order.to(torch.int32)
    block_rows = block_rows[:blocks * block_m].contiguous()
    block_start = torch.arange(blocks, device=ids.device) * block_m
    owner = torch.searchsorted(torch.cumsum(padded, 0), block_start, right=True)
    block_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return block_rows, block_expert


def _k_step(fmt: int, block_k: int, group: int) -> int:
    """A k step that never straddles a scale block (fp8) or group (int4); the packed K is a multiple of it."""
    step = {BF16: 32, INT8: 64, FP8: block_k, INT4: group}[fmt]
    for size in (64, 32, 16):
        if step % size == 0:
            return size
    raise ValueError(f"packed K step {step} is not a multiple of 16")


def _operands(w: DeviceExperts, data: torch.Tensor, scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                          int, int]:
    """(data in the element type the kernel indexes, scales pointer, tile size in those elements, scale columns)."""
    tile = data.shape[2]
    if w.fmt == BF16:
        return data.view(torch.bfloat16), data.view(torch.bfloat16), tile // 2, 0
    if w.fmt == INT8:
        return data.view(torch.int8), scales, tile, scales.shape[2]
    if w.fmt == INT4:
        return data, data.view(torch.float32), tile, 0
    return data, scales, tile, scales.shape[2]


def tile_shape(pairs: int, experts: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for `pairs` (token, expert) pairs over a layer of `experts`: taller blocks when each
    expert gets enough pairs to fill them (fewer passes over its weights), short ones for a few tokens (a block
    of 64 rows for 3 pairs would be mostly padding). On an H100 at 256 pairs per expert (DeepSeek-V3 fp8, an 8K
    pass) 128x64 ran 3.5x faster than 16x32 and 1.17x faster than 64x64; 64x128 and 128x128 were slower
    (docs/BENCHMARKS.md)."""
    per_expert = pairs / max(experts, 1)
    if per_expert >= 128:
        return 128, 64
    if per_expert >= 64:
        return 64, 64
    if per_expert >= 24:
        return 32, 64
    return 16, 32


def fused_moe(w: DeviceExperts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) over the experts present in `w`
    (others contribute nothing: another device or the CPU computes them). x [T, H] bf16 or fp32 -> [T, H].
    block_m / block_n: the tile (powers of two from 16), by default `tile_shape`'s."""
    tokens, topk = topk_ids.shape
    if x.shape != (tokens, w.hidden) or x.stride(1) != 1:
        raise ValueError(f"fused_moe: x {tuple(x.shape)} does not match {tokens} tokens of hidden size {w.hidden}")
    if tokens == 0:
        return torch.zeros_like(x)
    auto_m, auto_n = tile_shape(tokens * topk, w.slot.numel())
    block_m, block_n = block_m or auto_m, block_n or auto_n
    if any(b < 16 or b & (b - 1) for b in (block_m, block_n)):
        raise ValueError(f"fused_moe: block_m and block_n are powers of two from 16, got {block_m} x {block_n}")
    block_rows, block_expert = group_by_expert(topk_ids, w.slot, block_m)
    blocks = block_expert.numel()
    weights = topk_weights.float().contiguous()
    upcast = upcast_dots(x.dtype)
    inter = torch.empty(blocks * block_m, w.inter, dtype=x.dtype, device=x.device)
    pairs = tokens * topk
    d13, s13, tile13, cols13 = _operands(w, w.w13, w.w13_scales)
    k_step = _k_step(w.fmt, w.block_k, w.group)
    _gate_up_kernel[(blocks, triton.cdiv(w.inter, block_n))](
        x, block_rows, block_expert, w.slot, d13, s13, inter, x.stride(0), inter.stride(0), pairs, w.hidden, w.inter,
        w.kp13, w.w13.shape[1], cols13, TOPK=topk, FMT=w.fmt, TILE=tile13, BLOCK_K_SCALE=w.block_k, GROUP=w.group,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=k_step, UPCAST=upcast)
    out = torch.zeros(pairs, w.hidden, dtype=torch.float32, device=x.device)
    d2, s2, tile2, cols2 = _operands(w, w.w2, w.w2_scales)
    _down_kernel[(blocks, triton.cdiv(w.hidden, block_n))](
        inter, block_rows, block_expert, w.slot, d2, s2, weights, out, inter.stride(0), out.stride(0), pairs,
        w.hidden, w.inter, w.kp2, w.w2.shape[1], cols2, FMT=w.fmt, TILE=tile2, BLOCK_K_SCALE=w.block_k,
        GROUP=w.group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=k_step, UPCAST=upcast)
    return out.view(tokens, topk, w.hidden).sum(dim=1).to(x.dtype)
