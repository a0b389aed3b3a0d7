"""The elementwise kernels, the KV-cache store and the per-head linear against their torch references: odd and
model-sized shapes, fp32 and bf16, strided rows where the models pass them (gate / up halves, a fused
projection's v or q columns, MLA's cache and query parts), and every instruction set for the vector exp."""

from __future__ import annotations

import pytest
import torch
from conftest import ISAS

from cpu_kernels.attention import store_kv, store_kv_reference
from cpu_kernels.elementwise import (
    add,
    add_reference,
    copy_into,
    gather_rows,
    gather_rows_reference,
    sigmoid,
    sigmoid_reference,
    silu_mul,
    silu_mul_reference,
    widen,
    widen_reference,
)
from cpu_kernels.linear import PackedHeads, head_linear, head_linear_reference

SHAPES = [(1, 1), (1, 7), (3, 17), (1, 2048), (5, 4097), (64, 2048)]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@DTYPES
def test_add_rounds_as_torch(shape, dtype):
    a, b = randn(*shape, seed=1, dtype=dtype), randn(*shape, seed=2, dtype=dtype)
    assert torch.equal(add(a, b), add_reference(a, b))
    assert torch.equal(add(a[:0], b[:0]), a[:0])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_widen_is_exact(shape):
    x = randn(*shape, seed=3, dtype=torch.bfloat16)
    for isa in ISAS:
        assert torch.equal(widen(x, isa=isa), widen_reference(x))


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 15), (2, 17), (3, 768), (5, 1407), (40, 96)], ids=str)
@DTYPES
def test_silu_mul_matches_reference(rows, cols, dtype):
    """gate / up as the two halves of one fused projection output (strided rows). fp32: another exp, so fp32
    rounding; bf16: silu is rounded before the product as torch rounds it, so the bits agree but where the
    exp's last fp32 bit moves a rounding."""
    fused = randn(rows, 2 * cols, seed=rows * 13 + cols, dtype=dtype)
    gate, up = fused[:, :cols], fused[:, cols:]
    ref = silu_mul_reference(gate, up)
    for isa in ISAS:
        out = silu_mul(gate, up, isa=isa)
        assert out.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=3e-6, atol=1e-7)
        else:
            torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=0)
            assert (out != ref).float().mean().item() < 0.01


@pytest.mark.parametrize("heads,dim,block_size", [(4, 128, 16), (1, 576, 64), (3, 5, 7)], ids=str)
@DTYPES
def test_store_kv_writes_the_slots_torch_writes(heads, dim, block_size, dtype):
    blocks, n = 6, 5
    g = torch.Generator().manual_seed(heads * dim)
    slots = torch.randperm(blocks * block_size, generator=g)[:n]
    fused = randn(n, 3 * heads * dim + 1, seed=4, dtype=dtype)
    for values in (fused[:, 1:1 + heads * dim].reshape(n, heads, dim),  # strided rows, as v of a fused qkv
                   fused[:, 1:1 + heads * dim].contiguous().view(n, heads, dim)):
        cache, ref = (randn(blocks, block_size, heads, dim, seed=5, dtype=dtype) for _ in range(2))
        store_kv(cache, slots, values)
        store_kv_reference(ref, slots, values)
        assert torch.equal(cache, ref)


@pytest.mark.parametrize("n", [1, 15, 256, 4097])
def test_sigmoid_agrees_within_a_few_ulps(n):
    x = randn(n, seed=n, dtype=torch.float32, scale=8.0)
    x[0] = 100.0  # saturated ends
    if n > 1:
        x[1] = -100.0
    for isa in ISAS:
        torch.testing.assert_close(sigmoid(x, isa=isa), sigmoid_reference(x), rtol=2e-6, atol=1e-30)


def test_mla_latent_and_rope_key_go_into_their_parts_of_the_cache_row():
    cache, ref = torch.zeros(3, 4, 9), torch.zeros(3, 4, 9)
    latent, rope = randn(2, 6, seed=6, dtype=torch.float32), randn(2, 3, seed=7, dtype=torch.float32)
    slots = torch.tensor([5, 10])
    store_kv(cache[..., :6], slots, latent)
    store_kv(cache[..., 6:], slots, rope)
    store_kv_reference(ref, slots, torch.cat([latent, rope], dim=-1))
    assert torch.equal(cache, ref)


def test_copy_into_strided_rows():
    dst = torch.zeros(3, 4, 10, dtype=torch.bfloat16)
    src = randn(3, 4, 3, seed=8, dtype=torch.bfloat16)
    copy_into(dst[..., 7:], src)
    assert torch.equal(dst[..., 7:], src) and not dst[..., :7].any()
    with pytest.raises(ValueError, match="one shape"):
        copy_into(dst[..., :2], src)


@pytest.mark.parametrize("rows,shape", [(1, (7,)), (5, (2048,)), (3, (1, 64)), (64, (17, 3)), (0, (5,))], ids=str)
@DTYPES
def test_gather_rows_is_index_select(rows, shape, dtype):
    table = randn(101, *shape, seed=rows, dtype=dtype)
    index = torch.randint(0, 101, (rows,), generator=torch.Generator().manual_seed(rows))
    index[:1] = 100  # the last row, and repeats
    out = torch.full((rows, *shape), 7, dtype=dtype)
    assert torch.equal(gather_rows(table, index, out), gather_rows_reference(table, index, torch.empty_like(out)))


def test_gather_rows_refuses_an_index_outside_the_table_before_writing():
    table = randn(10, 4, seed=9, dtype=torch.float32)
    out = torch.zeros(3, 4)
    for bad in (10, -1):
        with pytest.raises(ValueError, match=f"row index {bad} at 2 is outside the table's 10 rows"):
            gather_rows(table, torch.tensor([1, 2, bad]), out)
        assert not out.any()
    with pytest.raises(ValueError, match="int64 indices"):
        gather_rows(table, torch.tensor([1, 2, 3], dtype=torch.int32), out)


@pytest.mark.parametrize("tokens,heads,n,k", [(1, 128, 512, 128), (3, 16, 128, 512), (2, 5, 24, 17), (4, 1, 7, 33)],
                         ids=str)
@DTYPES
def test_head_linear_matches_reference(tokens, heads, n, k, dtype):
    """Strided input rows (q's nope columns of a [q | kv_a] projection) and output written into the first columns
    of a wider buffer, as MLA's absorbed decode passes them; every instruction set."""
    w = randn(heads, n, k, seed=heads + n, dtype=torch.bfloat16, scale=0.2)
    packed = PackedHeads.pack(w)
    fused = randn(tokens, heads * (k + 5) + 3, seed=tokens + k, dtype=dtype)
    x = fused[:, :heads * (k + 5)].view(tokens, heads, k + 5)[..., :k]
    ref = head_linear_reference(w, x)
    for isa in ISAS:
        buf = torch.zeros(tokens, heads, n + 4, dtype=dtype)
        out = head_linear(packed, x, out=buf[..., :n], isa=isa)
        assert not buf[..., n:].any()
        if dtype == torch.float32:  # fp32 inputs as hi + lo bf16 halves, fp32 sums in another order
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=5e-4)
        else:
            torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-2)
        assert torch.equal(head_linear(packed, x.contiguous(), isa=isa), out)


def test_bad_inputs_are_rejected():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one shape"):
        add(x, x.float())
    with pytest.raises(ValueError, match="one shape"):
        add(x, x[:1])
    with pytest.raises(ValueError, match="gate and up"):
        silu_mul(x, x[:, :4])
    with pytest.raises(ValueError, match="bfloat16 CPU"):
        widen(x.float())
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside the cache"):
        store_kv(cache, torch.tensor([3, 8]), x.view(2, 1, 8))
    assert torch.equal(cache, torch.zeros_like(cache))  # nothing written before the check
    with pytest.raises(ValueError, match="store_kv needs"):
        store_kv(cache, torch.tensor([0, 1]), x.view(2, 8, 1))
    with pytest.raises(ValueError, match="sigmoid reads"):
        sigmoid(x)
    packed = PackedHeads.pack(torch.zeros(2, 16, 8).bfloat16())
    with pytest.raises(ValueError, match=r"\[tokens, 2, 8\]"):
        head_linear(packed, torch.zeros(1, 3, 8, dtype=torch.bfloat16))
