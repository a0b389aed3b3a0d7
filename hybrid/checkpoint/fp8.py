"""DeepSeek-style fp8 e4m3 weights with 128x128 block scales: the pure-torch dequantization reference."""

from __future__ import annotations

import torch


def check_block_scales(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """Raises ValueError unless scale_inv holds one scale per (block[0] x block[1]) tile of the 2-D weight."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"fp8 weight and scale must be 2-D, got {tuple(weight.shape)} and {tuple(scale_inv.shape)}")
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} "
                         f"for a {rows}x{cols} weight in {block[0]}x{block[1]} blocks")


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Returns weight * scale_inv broadcast over (block[0] x block[1]) tiles, in float32.

    `scale_inv` has ceil(rows / block[0]) x ceil(cols / block[1]) entries: edge tiles may be partial.
    """
    check_block_scales(weight, scale_inv, block)
    rows, cols = weight.shape
    br, bc = block
    scale = scale_inv.float().repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return weight.float() * scale
