"""The attention backend an engine config names: torch, cpu (C++ kernels) or triton (gpu/ kernels)."""

from __future__ import annotations

import os

import torch

from hybrid.layers.attention.backend import AttentionBackend


def create_attention_backend(name: str, device: torch.device, num_threads: int | None = None) -> AttentionBackend:
    if name == "triton":
        if device.type == "cpu":
            # Triton kernels reach CPU tensors only through its interpreter, read when kernels are defined.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from hybrid.layers.attention.triton_backend import TritonAttention

        return TritonAttention()
    if name == "cpu":
        from hybrid.layers.attention.cpu_backend import CpuAttention

        return CpuAttention(num_threads)
    if name == "torch":
        from hybrid.layers.attention.torch_backend import TorchAttention

        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r} (torch, cpu or triton)")
