"""Top-k expert routing: softmax top-k (Qwen3-MoE) and DeepSeek-V3's noaux_tc group-limited sigmoid top-k."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.layers.parameter import empty_param


class SoftmaxTopKRouter(nn.Module):
    """Router logits in the model dtype, softmax in float32, optional renormalization of the top-k."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_param(num_experts, hidden, dtype=dtype)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.kernel = False

    def use_kernel(self) -> None:
        """Softmax and top-k in one CPU kernel call (cpu_kernels.routing): the same experts in the same order,
        int32 ids; the logits stay a torch linear, whose sums the routing must see unchanged."""
        self.kernel = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        if self.kernel:
            from cpu_kernels.routing import softmax_topk

            return softmax_topk(logits, self.top_k, self.norm_topk_prob)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype)


class GroupedSigmoidRouter(nn.Module):
    """noaux_tc: sigmoid scores plus a correction bias choose groups (by their top-2 sum) then experts;
    the weights are the unbiased scores, optionally renormalized, times routed_scaling_factor (float32)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_param(num_experts, hidden, dtype=dtype)
        self.e_score_correction_bias = empty_param(num_experts, dtype=torch.float32)
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, routed_scaling_factor
        self.kernel = False

    def use_kernel(self) -> None:
        """Group and expert selection in one CPU kernel call (cpu_kernels.routing): the same ids in the same
        order; the linear and the sigmoid stay torch. Called before the weights load: the weight is then kept
        in fp32, as the linear reads it, instead of being widened on every call (the same values)."""
        self.kernel = True
        self.weight = empty_param(*self.weight.shape, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        if self.kernel:
            from cpu_kernels.routing import grouped_topk

            return grouped_topk(scores, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                                self.norm_topk_prob, self.scaling)
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling
