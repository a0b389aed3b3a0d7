"""RMSNorm on the kernels' thread pool (csrc/norm.cpp), and its reference."""

from __future__ import annotations

import torch

from cpu_kernels.moe import runner


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num_threads: int | None = None) -> torch.Tensor:
    """x [..., dim] and weight [dim], both bf16 or both fp32 on the CPU -> weight * dtype(x * rsqrt(mean(x^2) +
    eps)) with the mean over fp32 squares, as the reference models compute it."""
    dim = weight.shape[-1]
    if (x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype or weight.dim() != 1
            or x.shape[-1] != dim or x.device.type != "cpu" or weight.device.type != "cpu"):
        raise ValueError(f"rms_norm needs bfloat16 or float32 CPU tensors x [..., {dim}] and weight [{dim}] of "
                         f"one dtype, got x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        runner(num_threads).rms_norm(x.data_ptr(), out.data_ptr(), weight.data_ptr(), x.numel() // dim, dim, eps,
                                     x.dtype == torch.float32)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same in torch ops (transformers' Qwen3 / DeepSeek-V3 RMSNorm)."""
    f = x.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
