"""KV-cache store: each new token's row written to its slot of a paged cache (Triton, with a torch reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.paged_reference import write_cache


@triton.jit
def _store_kernel(cache, slots, values, row_width, stride_value, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    part = tl.program_id(1)
    slot = tl.load(slots + token).to(tl.int64)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row_width
    row = tl.load(values + token * stride_value + cols, mask=mask)
    tl.store(cache + slot * row_width + cols, row, mask=mask)


def store_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """cache [blocks, block_size, ...] contiguous; values [N, ...] with the same trailing shape."""
    n = values.shape[0]
    if n == 0:
        return
    width = cache[0, 0].numel()
    if not cache.is_contiguous() or values[0].numel() != width:
        raise ValueError(f"store_kv needs a contiguous cache and rows of {width} values")
    flat = values.reshape(n, width).to(cache.dtype).contiguous()
    block = min(1024, triton.next_power_of_2(width))
    _store_kernel[(n, triton.cdiv(width, block))](cache, slot_mapping, flat, width, flat.stride(0), BLOCK=block)


store_kv_reference = write_cache
