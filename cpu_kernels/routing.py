"""Softmax top-k expert routing on the kernels' thread pool (csrc/routing.cpp), and its reference."""

from __future__ import annotations

import torch

from cpu_kernels.moe import runner


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool,
                 num_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] bf16 or fp32 on the CPU -> (ids [T, k] int32, weights [T, k] in the logits' dtype): the k
    largest of softmax(logits) in fp32, chosen and ordered as torch.topk chooses them (ties included),
    optionally renormalized to sum to one. The weights agree with `softmax_topk_reference` to fp32 rounding
    (another exp), then rounded to the dtype."""
    if logits.dim() != 2 or logits.dtype not in (torch.bfloat16, torch.float32) or logits.device.type != "cpu":
        raise ValueError(f"router logits must be [tokens, experts] bfloat16 or float32 on the CPU, got "
                         f"{tuple(logits.shape)} {logits.dtype} on {logits.device}")
    tokens, experts = logits.shape
    if not 1 <= k <= experts:
        raise ValueError(f"top-k must be in [1, {experts}], got {k}")
    logits = logits.contiguous()
    ids = torch.empty(tokens, k, dtype=torch.int32)
    weights = torch.empty(tokens, k, dtype=logits.dtype)
    if tokens:
        runner(num_threads).softmax_topk(logits.data_ptr(), logits.dtype == torch.float32, tokens, experts, k,
                                         renormalize, ids.data_ptr(), weights.data_ptr())
    return ids, weights


def softmax_topk_reference(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch ops (transformers' Qwen3-MoE router after its linear)."""
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights.to(logits.dtype)
