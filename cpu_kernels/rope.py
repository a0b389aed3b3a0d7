"""Rotary position embedding on the kernels' thread pool (csrc/rope.cpp), and its reference."""

from __future__ import annotations

import torch

from cpu_kernels.moe import resolve_isa, runner


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False,
         num_threads: int | None = None, isa: int | None = None) -> torch.Tensor:
    """x [T, H, R] (rows may be strided; the last dimension contiguous), cos and sin [T, R] or [T, 1, R], all
    bf16 or all fp32 on the CPU -> x rotated, [T, H, R] contiguous: the same bits as `rope_reference`."""
    if (x.dim() != 3 or x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu"
            or x.shape[2] % 2 or x.stride(2) != 1):
        raise ValueError(f"rope needs x [tokens, heads, even dim] bfloat16 or float32 on the CPU with contiguous "
                         f"rows, got {tuple(x.shape)} {x.dtype} strides {x.stride()} on {x.device}")
    t, h, r = x.shape
    for name, table in (("cos", cos), ("sin", sin)):
        if (table.dtype != x.dtype or table.device.type != "cpu" or table.shape[0] != t or table.shape[-1] != r
                or table.numel() != t * r):
            raise ValueError(f"{name} must be [{t}, {r}] (or [{t}, 1, {r}]) {x.dtype} on the CPU, got "
                             f"{tuple(table.shape)} {table.dtype}")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(t, h, r, dtype=x.dtype)
    if out.numel():
        runner(num_threads).rope(x.data_ptr(), x.stride(0), x.stride(1), out.data_ptr(), cos.data_ptr(),
                                 sin.data_ptr(), t, h, r, interleave, x.dtype == torch.float32, resolve_isa(isa))
    return out


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """The same in torch ops: transformers' Qwen3 rotate_half form, or DeepSeek-V3's interleaved pairs
    de-interleaved to [evens | odds]."""
    cos, sin = cos.view(x.shape[0], 1, x.shape[2]), sin.view(x.shape[0], 1, x.shape[2])
    half = x.shape[2] // 2
    if interleave:
        x1, x2, c, s = x[..., 0::2], x[..., 1::2], cos[..., :half], sin[..., :half]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
