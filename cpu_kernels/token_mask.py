"""Grammar masks applied to next-token logits (csrc/token_mask.cpp), and their torch reference."""

from __future__ import annotations

import numpy as np
import torch

from cpu_kernels import _C
from cpu_kernels.moe import resolve_isa


def mask_logits_(logits: torch.Tensor, bits: np.ndarray, rows: list[int] | None = None,
                 isa: int | None = None) -> torch.Tensor:
    """In place: row rows[i] of logits (fp32 [batch, vocab] on the CPU; rows None: every row) keeps the tokens
    whose bit is set in bits[i] (an int32 bitmask [rows, words], bit t % 32 of word t // 32 for token t) and gets
    -inf elsewhere, also for tokens past the bitmask. Returns logits. Called once per decode step: the checks are
    kept cheap."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 or logits.device.type != "cpu":
        raise ValueError(f"logits must be fp32 [batch, vocab] rows on the CPU, got {tuple(logits.shape)} "
                         f"{logits.dtype} on {logits.device}")
    if bits.dtype != np.int32:
        raise ValueError(f"bits must be int32, got {bits.dtype}")
    _C.mask_logits(resolve_isa(isa), logits.data_ptr(), logits.shape[0], logits.stride(0), logits.shape[1], rows,
                   bits)
    return logits


def mask_logits_reference(logits: torch.Tensor, bits: np.ndarray, rows: list[int] | None = None) -> torch.Tensor:
    vocab = logits.shape[1]
    rows = list(range(logits.shape[0])) if rows is None else rows
    flags = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
    allowed[:, :flags.shape[1]] = torch.from_numpy(flags).bool()
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out
