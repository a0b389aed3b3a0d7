"""The attention backend an engine config names: torch, cpu (C++ kernels) or triton (gpu/ kernels)."""

from __future__ import annotations

import torch

from hybrid.layers.attention.backend import AttentionBackend
from hybrid.triton_env import prepare_triton


def create_attention_backend(name: str, device: torch.device, num_threads: int | None = None) -> AttentionBackend:
    if name == "triton":
        prepare_triton(device)
        from hybrid.layers.attention.triton_backend import TritonAttention

        return TritonAttention()
    if name == "cpu":
        from hybrid.layers.attention.cpu_backend import CpuAttention

        return CpuAttention(num_threads)
    if name == "torch":
        from hybrid.layers.attention.torch_backend import TorchAttention

        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r} (torch, cpu or triton)")
