"""Softmax top-k routing kernel against torch: the same experts in the same order on inputs full of ties (both
of torch.topk's algorithms: nth_element for k * 64 > experts, partial_sort otherwise), weights to fp32 rounding,
and the model's router giving the same ids and weights through the kernel."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels.routing import softmax_topk, softmax_topk_reference
from hybrid.models.router import SoftmaxTopKRouter


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


def test_router_module_routes_the_same_through_the_kernel():
    g = torch.Generator().manual_seed(1)
    torch_router = SoftmaxTopKRouter(64, 32, 4, True, torch.bfloat16)
    torch_router.weight.data = torch.randn(32, 64, generator=g).bfloat16()
    kernel_router = SoftmaxTopKRouter(64, 32, 4, True, torch.bfloat16)
    kernel_router.weight.data = torch_router.weight.data
    kernel_router.use_kernel()
    x = torch.randn(40, 64, generator=g).bfloat16()
    ids, weights = kernel_router(x)
    ref_ids, ref_weights = torch_router(x)
    assert torch.equal(ids.long(), ref_ids)
    assert torch.equal(weights, ref_weights)


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
