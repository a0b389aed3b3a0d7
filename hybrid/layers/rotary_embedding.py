"""Rotary position embedding: plain RoPE and YaRN, in the half-split (Qwen) or interleaved (DeepSeek) layout."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybrid.config import RopeConfig

if TYPE_CHECKING:
    from hybrid.layers.forward_batch import ForwardBatch


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(rope: RopeConfig, scale: float) -> float:
    """DeepSeek multiplies the attention softmax scale by mscale(factor, mscale_all_dim)^2 under YaRN."""
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        return scale * m * m
    return scale


def inv_freq_and_scaling(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base = rope.rotary_dim, rope.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, R] and k [T, Hk, R] at a batch's integer positions [T]. One instance is
    shared by every attention layer; its frequencies are a buffer, so they move with the model to its device."""

    def __init__(self, rope: RopeConfig):
        super().__init__()
        inv_freq, self.attention_scaling = inv_freq_and_scaling(rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = rope.interleave
        self.kernel = False
        self.tables: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def use_kernel(self) -> None:
        """Rotate with the CPU kernels' one-pass RoPE (cpu_kernels.rope): the same bits as the torch ops."""
        self.kernel = True

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def table(self, dtype: torch.dtype, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [positions, 1, R] of every position below `positions`, the rows cos_sin gives for each, from
        which a decode program gathers its step's rows (cpu_decode_programs.py): made once per dtype and length,
        and kept, since the programs recorded over it read its address."""
        key = (dtype, positions)
        if key not in self.tables:
            self.tables[key] = self.cos_sin(torch.arange(positions, device=self.inv_freq.device), dtype)
        return self.tables[key]

    def step_key(self, dtype: torch.dtype) -> tuple[int, torch.dtype]:
        """Where a step's ForwardBatch keeps this embedding's cos / sin for `dtype` (ForwardBatch.derived)."""
        return id(self), dtype

    def forward(self, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated at batch.positions; the cos / sin of a step are computed once for all layers."""
        cos, sin = batch.derived(self.step_key(q.dtype), lambda: self.cos_sin(batch.positions, q.dtype))
        if self.kernel:
            from cpu_kernels.rope import rope

            return rope(q, cos, sin, self.interleave), rope(k, cos, sin, self.interleave)
        if self.interleave:
            # Pairs (x0, x1), (x2, x3)... rotate together; the output is laid out as [evens | odds], which
            # leaves q.k unchanged because q and k get the same permutation.
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half], sin[..., :half]

            def rot(x: torch.Tensor) -> torch.Tensor:
                x1, x2 = x[..., 0::2], x[..., 1::2]
                return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

            return rot(q), rot(k)

        def rotate_half(x: torch.Tensor) -> torch.Tensor:
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
