"""Top-k expert routing after the router's linear, on the kernels' thread pool (csrc/routing.cpp): softmax top-k
(Qwen3-MoE) and DeepSeek-V3's grouped top-k over sigmoid scores, and their references."""

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


def grouped_topk(scores: torch.Tensor, bias: torch.Tensor, k: int, groups: int, keep_groups: int, renormalize: bool,
                 scaling: float, num_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's noaux_tc routing. scores [T, E] (sigmoid of the router logits) and bias [E], fp32 on the
    CPU -> (ids [T, k] int32, weights [T, k] fp32): the `keep_groups` of `groups` expert groups with the
    largest sums of their two best score + bias stay, the k best of their experts are picked in
    torch.topk(sorted=False)'s order and weighted by their scores (divided by their sum + 1e-20 when
    `renormalize`) times `scaling`, as `grouped_topk_reference` computes them."""
    if (scores.dim() != 2 or scores.dtype != torch.float32 or bias.dtype != torch.float32
            or bias.shape != scores.shape[1:] or scores.device.type != "cpu" or bias.device.type != "cpu"):
        raise ValueError(f"grouped_topk needs float32 CPU scores [tokens, experts] and bias [experts], got "
                         f"{tuple(scores.shape)} {scores.dtype} and {tuple(bias.shape)} {bias.dtype}")
    tokens, experts = scores.shape
    if groups < 1 or experts % groups or experts // groups < 2 or not 1 <= keep_groups <= groups:
        raise ValueError(f"{experts} experts cannot form {groups} groups of two or more, {keep_groups} kept")
    if not 1 <= k <= keep_groups * (experts // groups):
        raise ValueError(f"top-k must be in [1, {keep_groups * (experts // groups)}] (the kept groups' experts), "
                         f"got {k}")
    scores, bias = scores.contiguous(), bias.contiguous()
    ids = torch.empty(tokens, k, dtype=torch.int32)
    weights = torch.empty(tokens, k, dtype=torch.float32)
    if tokens:
        runner(num_threads).grouped_topk(scores.data_ptr(), bias.data_ptr(), tokens, experts, k, groups,
                                         keep_groups, renormalize, scaling, ids.data_ptr(), weights.data_ptr())
    return ids, weights


def grouped_topk_reference(scores: torch.Tensor, bias: torch.Tensor, k: int, groups: int, keep_groups: int,
                           renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch ops (transformers' DeepseekV3MoE.route_tokens_to_experts after the sigmoid)."""
    tokens, experts = scores.shape
    choice = scores + bias
    group_scores = choice.view(tokens, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=keep_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(tokens, experts)
    ids = torch.topk(choice.masked_fill(~score_mask.bool(), float("-inf")), k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * scaling
