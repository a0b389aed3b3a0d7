"""RMSNorm kernel against its torch reference: odd and model-sized widths, one row to a prefill's worth (the
threaded path), fp32 and bf16, and per-head rows read in place from a fused projection's strided columns."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels.norm import rms_norm, rms_norm_reference


def inputs(rows: int, dim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    weight = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    return x, weight


def assert_norm_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: the sum of squares is taken in another order, so agreement to fp32 rounding. bf16: the same
    values except where that last fp32 bit moves a rounding, then by one bf16 step."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
        return
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=0)
    assert (out != ref).float().mean().item() < 0.01


@pytest.mark.parametrize("rows,dim", [(1, 1), (1, 7), (3, 16), (5, 17), (36, 128), (1, 2048), (2, 7171),
                                      (33, 1536), (600, 2048)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rms_norm_matches_reference(rows, dim, dtype):
    x, weight = inputs(rows, dim, dtype, seed=rows * 31 + dim)
    assert_norm_close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


def test_leading_dims_eps_and_non_contiguous_inputs():
    x, weight = inputs(24, 64, torch.bfloat16, seed=3)
    heads = x.view(3, 8, 64)
    assert_norm_close(rms_norm(heads, weight, 1e-2), rms_norm_reference(heads, weight, 1e-2))
    cols = x.t().contiguous().t()
    assert not cols.is_contiguous()
    assert_norm_close(rms_norm(cols, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    zeros = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(zeros, weight, 1e-6), zeros)
    assert rms_norm(x[:0], weight, 1e-6).shape == (0, 64)


@pytest.mark.parametrize("tokens,heads,dim,width", [(1, 32, 128, 5120), (3, 4, 128, 5120), (5, 3, 24, 97),
                                                     (2, 1, 7, 7)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_strided_heads_are_read_in_place(tokens, heads, dim, width, dtype):
    """q / k of a fused qkv projection: [tokens, heads, dim] views of [tokens, width] rows (no copy made)."""
    g = torch.Generator().manual_seed(tokens + heads * 7 + dim)
    fused = (torch.randn(tokens, width, generator=g) * 2).to(dtype)
    weight = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    view = fused[:, width - heads * dim:].view(tokens, heads, dim)
    out = rms_norm(view, weight, 1e-6)
    assert out.is_contiguous() and out.shape == view.shape
    assert_norm_close(out, rms_norm_reference(view, weight, 1e-6))


def test_bad_inputs_are_rejected():
    x, weight = inputs(4, 32, torch.bfloat16, seed=5)
    with pytest.raises(ValueError, match="one dtype"):
        rms_norm(x, weight.float(), 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        rms_norm(x[:, :31], weight, 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        rms_norm(x.half(), weight.half(), 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        rms_norm(x, weight[None], 1e-6)
