"""Routing kernels against torch: the same experts in the same order on inputs full of ties (both of
torch.topk's algorithms: nth_element for k * 64 > experts, partial_sort otherwise). Softmax top-k weights agree
to fp32 rounding; DeepSeek's grouped top-k repeats torch's fp32 operations, bit for bit where its sum of k
weights runs in torch's order (k = 8; k = 6 differs in the last bit). The models' routers, logits included, give
the same ids through the kernels, and the same weights (DeepSeek's to fp32 rounding: its sigmoid takes another
exp)."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels.linear import PackedLinear
from cpu_kernels.routing import grouped_topk, grouped_topk_reference, softmax_topk, softmax_topk_reference
from hybrid.layers.parameter import fill_param
from hybrid.layers.router import GroupedSigmoidRouter, SoftmaxTopKRouter


@pytest.mark.parametrize("experts,k", [(128, 8), (60, 4), (8, 2), (16, 1), (7, 7), (512, 8), (1024, 3)], ids=str)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_softmax_topk_picks_what_torch_picks(experts, k, renormalize, dtype):
    g = torch.Generator().manual_seed(experts * 10 + k)
    ties = torch.randint(-6, 6, (300, experts), generator=g).float() / 4  # many equal logits per row
    spread = torch.randn(300, experts, generator=g) * 4
    logits = torch.cat([ties, spread]).to(dtype)
    ids, weights = softmax_topk(logits, k, renormalize)
    ref_ids, ref_weights = softmax_topk_reference(logits, k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == dtype
    assert torch.equal(ids, ref_ids)
    if dtype == torch.float32:
        torch.testing.assert_close(weights, ref_weights, rtol=4e-6, atol=1e-7)
    else:  # bf16 rounding hides the fp32 differences but where they straddle a rounding boundary
        torch.testing.assert_close(weights.float(), ref_weights.float(), rtol=2 ** -7, atol=0)
        assert (weights != ref_weights).float().mean().item() < 1e-3


def exact_sums(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Multiples of 1/8 in [-1/4, 1/4]: every product and sum of 64 of them is exact in bf16 and fp32, so the
    router's logits are the same bits in any summation order, ties included."""
    return (torch.randint(-2, 3, (rows, cols), generator=g) / 8).bfloat16()


def test_router_module_routes_the_same_through_the_kernel():
    g = torch.Generator().manual_seed(1)
    torch_router = SoftmaxTopKRouter(64, 32, 4, True, torch.bfloat16)
    fill_param(torch_router, "weight", exact_sums(32, 64, g))
    kernel_router = SoftmaxTopKRouter(64, 32, 4, True, torch.bfloat16)
    kernel_router.use_kernel(PackedLinear.pack(torch_router.weight.data, "bf16"))
    assert kernel_router.weight is None
    x = exact_sums(40, 64, g)
    ids, weights = kernel_router(x)
    ref_ids, ref_weights = torch_router(x)
    assert torch.equal(ids.long(), ref_ids)
    assert torch.equal(weights, ref_weights)


@pytest.mark.parametrize("experts,groups,keep,k", [(256, 8, 4, 8), (64, 4, 2, 6), (16, 2, 1, 4), (64, 1, 1, 6),
                                                  (8, 4, 2, 3), (96, 8, 3, 8)], ids=str)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
def test_grouped_topk_picks_what_torch_picks(experts, groups, keep, k, renormalize):
    g = torch.Generator().manual_seed(experts + groups * 7 + k)
    logits = torch.cat([torch.randint(-4, 4, (300, experts), generator=g).float() / 2,  # ties within and
                        torch.randn(300, experts, generator=g) * 3])                  # between groups
    scores = logits.sigmoid()
    bias = (torch.randint(-2, 3, (experts,), generator=g) / 8).float()
    ids, weights = grouped_topk(scores, bias, k, groups, keep, renormalize, 2.5)
    ref_ids, ref_weights = grouped_topk_reference(scores, bias, k, groups, keep, renormalize, 2.5)
    assert torch.equal(ids, ref_ids)
    if k == 8 or not renormalize:
        assert torch.equal(weights, ref_weights)
    else:
        torch.testing.assert_close(weights, ref_weights, rtol=5e-7, atol=0)


def test_grouped_router_module_routes_the_same_through_the_kernel():
    g = torch.Generator().manual_seed(2)
    routers = [GroupedSigmoidRouter(64, 32, 8, 4, 2, True, 2.5, torch.bfloat16) for _ in range(2)]
    weight, bias = exact_sums(32, 64, g), torch.randn(32, generator=g) / 10
    fill_param(routers[0], "weight", weight)
    routers[1].use_kernel(PackedLinear.pack(weight, "bf16"))
    for router in routers:
        fill_param(router, "e_score_correction_bias", bias)
    x = exact_sums(40, 64, g)
    (ref_ids, ref_weights), (ids, weights) = routers[0](x), routers[1](x)
    # the same experts (tied logits give tied sigmoids in any implementation); the kernels' sigmoid takes another
    # exp, so the weights agree to fp32 rounding
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="top-k"):
        softmax_topk(torch.randn(2, 8), 9, True)
    with pytest.raises(ValueError, match="top-k"):
        softmax_topk(torch.randn(2, 8), 0, True)
    with pytest.raises(ValueError, match="tokens, experts"):
        softmax_topk(torch.randn(2, 8).half(), 2, True)
    with pytest.raises(ValueError, match="tokens, experts"):
        softmax_topk(torch.randn(8), 2, True)
    assert softmax_topk(torch.randn(0, 8), 2, True)[0].shape == (0, 2)
    scores, bias = torch.rand(2, 16), torch.zeros(16)
    with pytest.raises(ValueError, match="groups of two"):
        grouped_topk(scores, bias, 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="groups of two"):
        grouped_topk(scores, bias, 2, 16, 1, True, 1.0)
    with pytest.raises(ValueError, match="kept groups"):
        grouped_topk(scores, bias, 5, 4, 1, True, 1.0)
    with pytest.raises(ValueError, match="float32"):
        grouped_topk(scores.bfloat16(), bias, 2, 4, 2, True, 1.0)
