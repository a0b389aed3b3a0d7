"""The pass over a step's logits before sampling (csrc/logits_scan.cpp): each row's greedy token and whether any
token can be drawn from it, in one read of the row, and its torch reference."""

from __future__ import annotations

import torch

from cpu_kernels import _C
from cpu_kernels.moe import resolve_isa


def logits_scan(logits: torch.Tensor, isa: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy int64 [rows], broken bool [rows]) of fp32 or bf16 logits [rows, vocab]: a broken row holds a NaN or
    +inf or nothing above -inf; greedy is the first index of a row's largest value, -1 for a broken row."""
    if (logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16) or logits.device.type != "cpu"
            or logits.shape[1] == 0):
        raise ValueError(f"logits_scan reads fp32 or bf16 CPU logits [rows, vocab >= 1], got {tuple(logits.shape)} "
                         f"{logits.dtype} on {logits.device}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    greedy = torch.empty(rows, dtype=torch.int64)
    broken = torch.empty(rows, dtype=torch.bool)
    _C.logits_scan(resolve_isa(isa), logits.data_ptr(), logits.dtype == torch.bfloat16, rows, vocab,
                   logits.stride(0), greedy.data_ptr(), broken.data_ptr())
    return greedy, broken


def logits_scan_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    broken = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | torch.isneginf(logits).all(-1)
    return torch.where(broken, -1, logits.argmax(-1)), broken
