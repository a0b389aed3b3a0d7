"""Top-k expert routing: softmax top-k (Qwen3-MoE) and DeepSeek-V3's noaux_tc group-limited sigmoid top-k.

A router is a Linear (its logits) followed by a selection. With the cpu backend its weight is packed like every
dense linear (bf16, or the checkpoint's fp8, whatever --dense-format says: the logits choose the experts) and the
logits come from the kernels' thread pool. The weight is read cold once per layer and step, which torch's
single-threaded matmul did at a fraction of the bandwidth: in a Qwen3-30B-A3B-shaped decode step on the 2-core
EPYC the router took 106 us per layer through torch and 42 us through the kernels; DeepSeek-V3's 256 x 7168
weight, which torch read widened to fp32, 300 us cold against 114 us. Selection runs in cpu_kernels.routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.layers.linear import Linear
from hybrid.layers.parameter import empty_param


class Router(Linear):
    """The logits x W^T of a [num_experts, hidden] router weight; subclasses choose experts from them."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype):
        super().__init__(hidden, num_experts, dtype)
        self.kernel = False

    def use_kernel(self, packed) -> None:
        """Logits through the packed weight, selection through cpu_kernels.routing."""
        super().use_kernel(packed)
        self.kernel = True


class SoftmaxTopKRouter(Router):
    """Router logits in the model dtype, softmax in float32, optional renormalization of the top-k."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, dtype: torch.dtype):
        super().__init__(hidden, num_experts, dtype)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(x)
        if self.kernel:
            from cpu_kernels.routing import softmax_topk

            return softmax_topk(logits, self.top_k, self.norm_topk_prob)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype)


class GroupedSigmoidRouter(Router):
    """noaux_tc: sigmoid scores of float32 logits plus a correction bias choose groups (by their top-2 sum) then
    experts; the weights are the unbiased scores, optionally renormalized, times routed_scaling_factor
    (float32)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, dtype: torch.dtype):
        super().__init__(hidden, num_experts, dtype)
        self.e_score_correction_bias = empty_param(num_experts, dtype=torch.float32)
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel:  # fp32 inputs give fp32 logits (cpu_kernels.linear)
            from cpu_kernels.elementwise import sigmoid, widen
            from cpu_kernels.routing import grouped_topk

            scores = sigmoid(super().forward(widen(x) if x.dtype == torch.bfloat16 else x.float()))
            return grouped_topk(scores, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                                self.norm_topk_prob, self.scaling)
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
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
