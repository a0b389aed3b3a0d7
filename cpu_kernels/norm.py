"""RMSNorm on the kernels' thread pool (csrc/norm.cpp), and its reference."""

from __future__ import annotations

import torch

from cpu_kernels.moe import runner


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num_threads: int | None = None) -> torch.Tensor:
    """x [..., dim] and weight [dim], both bf16 or both fp32 on the CPU -> weight * dtype(x * rsqrt(mean(x^2) +
    eps)) with the mean over fp32 squares, as the reference models compute it; contiguous. x [tokens, dim] or
    [tokens, heads, dim] may have strided tokens (columns of a fused projection's output) and is read in place."""
    dim = weight.shape[-1]
    if (x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype or weight.dim() != 1
            or x.shape[-1] != dim or x.device.type != "cpu" or weight.device.type != "cpu"):
        raise ValueError(f"rms_norm needs bfloat16 or float32 CPU tensors x [..., {dim}] and weight [{dim}] of "
                         f"one dtype, got x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    weight = weight.contiguous()
    if x.dim() == 3 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == dim):
        heads, token_stride = x.shape[1], x.stride(0)
    elif x.dim() == 2 and x.stride(1) == 1:
        heads, token_stride = 1, x.stride(0)
    else:
        x = x.contiguous()
        heads, token_stride = 1, dim
    out = torch.empty(x.shape, dtype=x.dtype)
    if x.numel():
        runner(num_threads).rms_norm(x.data_ptr(), heads, token_stride, out.data_ptr(), weight.data_ptr(),
                                     x.numel() // dim, dim, eps, x.dtype == torch.float32)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same in torch ops (transformers' Qwen3 / DeepSeek-V3 RMSNorm)."""
    f = x.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
