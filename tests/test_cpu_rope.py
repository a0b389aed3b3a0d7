"""Rotary embedding kernel against its torch reference, bit for bit: both layouts, odd head counts and
dims, strided rows (DeepSeek's rope slice of q), values over a wide range of magnitudes and NaNs, a prefill's
worth of tokens (the threaded path), fp32 and bf16, on every instruction set (the AVX-512 paths rotate 16 pairs
at a time); and the model's RotaryEmbedding giving the same bits either way."""

from __future__ import annotations

import pytest
import torch
from conftest import ISAS

from cpu_kernels.rope import rope, rope_reference
from hybrid.config import RopeConfig
from hybrid.layers.attention.torch_backend import TorchAttention
from hybrid.layers.forward_batch import ForwardBatch
from hybrid.layers.rotary_embedding import RotaryEmbedding


def wide(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random signs and magnitudes 2^-20..2^20, so products and sums round at every exponent gap."""
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 21, shape, generator=g).float())


@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 2), (1, 32, 128), (3, 5, 64), (7, 4, 10), (2, 16, 66),
                                              (600, 4, 64)], ids=str)
@pytest.mark.parametrize("interleave", [False, True], ids=["half", "interleave"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rope_is_bit_identical_to_reference(tokens, heads, dim, interleave, dtype):
    g = torch.Generator().manual_seed(tokens * 1000 + heads * 10 + dim)
    x = wide((tokens, heads, dim), g).to(dtype)
    x.view(-1)[:: 97] = float("nan")
    cos, sin = wide((tokens, dim), g).to(dtype), wide((tokens, dim), g).to(dtype)
    ref = rope_reference(x, cos, sin, interleave)
    for isa in ISAS:  # 16 pairs at a time on the AVX-512 paths, one at a time on the others; NaN where torch's
        torch.testing.assert_close(rope(x, cos, sin, interleave, isa=isa), ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_strided_rows_as_in_deepseek_q(dtype):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(9, 6, 128 + 64, generator=g).to(dtype)
    _, q_rope = q.split([128, 64], dim=-1)
    k = torch.randn(9, 512 + 64, generator=g).to(dtype)[:, 512:].view(9, 1, 64)
    cos, sin = torch.randn(9, 1, 64, generator=g).to(dtype), torch.randn(9, 1, 64, generator=g).to(dtype)
    for x in (q_rope, k):
        assert not x.is_contiguous()
        for isa in ISAS:
            assert torch.equal(rope(x, cos, sin, True, isa=isa), rope_reference(x, cos, sin, True))


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rotary_embedding_module_gives_the_same_bits_through_the_kernel(rope_type, dtype):
    cfg = RopeConfig(rotary_dim=64, rope_theta=10000.0, rope_type=rope_type, factor=4.0,
                     original_max_position_embeddings=256, interleave=rope_type == "yarn")
    torch_rope, kernel_rope = RotaryEmbedding(cfg), RotaryEmbedding(cfg)
    kernel_rope.use_kernel()
    positions = torch.tensor([0, 1, 2, 517, 4095, 3])
    batch = ForwardBatch(positions=positions, slot_mapping=positions, query_starts=[0], query_lens=[6],
                         context_lens=[6], block_tables=[torch.zeros(1, dtype=torch.int32)], kv_caches=[],
                         attention=TorchAttention())
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(6, 8, 64, generator=g).to(dtype), torch.randn(6, 2, 64, generator=g).to(dtype)
    for ours, ref in zip(kernel_rope(batch, q, k), torch_rope(batch, q, k)):
        assert torch.equal(ours, ref)


def test_bad_inputs_are_rejected():
    x, cos = torch.randn(2, 3, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="even dim"):
        rope(torch.randn(2, 3, 7), torch.randn(2, 7), torch.randn(2, 7))
    with pytest.raises(ValueError, match="contiguous"):
        rope(torch.randn(2, 8, 3).transpose(1, 2), cos, cos)
    with pytest.raises(ValueError, match="cos"):
        rope(x, cos[:1], cos)
    with pytest.raises(ValueError, match="sin"):
        rope(x, cos, cos.bfloat16())
