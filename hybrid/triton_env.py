"""Where the gpu/ Triton kernels run: on a CUDA device compiled, on a CPU "device" through Triton's interpreter."""

from __future__ import annotations

import os

import torch


def prepare_triton(device: torch.device) -> None:
    """Call before importing a gpu/ kernel module: Triton reads TRITON_INTERPRET when kernels are defined, and only
    its interpreter reaches CPU tensors."""
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
