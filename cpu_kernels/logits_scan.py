"""The pass over a step's logits before sampling (csrc/logits_scan.cpp): each row's greedy token and whether any
token can be drawn from it, the grammar masks of the constrained rows applied in place in the same read of the row,
and its torch reference."""

from __future__ import annotations

import numpy as np
import torch

from cpu_kernels import _C
from cpu_kernels.moe import resolve_isa

# A row's status (csrc/logits_scan.h).
OK, BROKEN, MASKED_OUT = 0, 1, 2


def logits_scan(logits: torch.Tensor, bits: np.ndarray | None = None, rows: list[int] | None = None,
                isa: int | None = None) -> tuple[list[int], list[int]]:
    """(greedy, status) per row of fp32 or bf16 logits [rows, vocab]. BROKEN: the row holds a NaN or +inf or
    nothing above -inf; MASKED_OUT: its mask leaves nothing above -inf; OK: greedy is the first index of the row's
    largest allowed value (-1 otherwise). With bits (an int32 bitmask [masked rows, words], bit t % 32 of word
    t // 32 for token t) row rows[i] (rows None: row i) keeps the tokens whose bit is set in bits[i] and gets -inf
    in place elsewhere, also for tokens past the bitmask; BROKEN is judged before the mask. Called once per decode
    step: the checks are kept cheap."""
    if (logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16) or not logits.is_cpu
            or logits.shape[1] == 0):
        raise ValueError(f"logits_scan reads fp32 or bf16 CPU logits [rows, vocab >= 1], got {tuple(logits.shape)} "
                         f"{logits.dtype} on {logits.device}")
    if bits is not None:
        if logits.stride(1) != 1 or logits.stride(0) < logits.shape[1]:  # rows that overlap would mask each other
            raise ValueError(f"masked logits must be contiguous, separate rows, got strides {logits.stride()}")
        if bits.dtype != np.int32:
            raise ValueError(f"bits must be int32, got {bits.dtype}")
    elif logits.stride(1) != 1:
        logits = logits.contiguous()
    return _C.logits_scan(resolve_isa(isa), logits.data_ptr(), logits.dtype == torch.bfloat16, logits.shape[0],
                          logits.shape[1], logits.stride(0), rows, bits)


def logits_scan_reference(logits: torch.Tensor, bits: np.ndarray | None = None,
                          rows: list[int] | None = None) -> tuple[list[int], list[int], torch.Tensor]:
    """logits_scan's (greedy, status) and the masked logits (a copy: the input is left as it was)."""
    values = logits.float()
    broken = torch.isnan(values).any(-1) | torch.isposinf(values).any(-1) | torch.isneginf(values).all(-1)
    masked = logits.clone()
    if bits is not None:
        rows = list(range(len(bits))) if rows is None else rows
        vocab = logits.shape[1]
        flags = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
        allowed[:, :flags.shape[1]] = torch.from_numpy(flags).bool()
        masked[rows] = masked[rows].masked_fill(~allowed, float("-inf"))
    nothing = torch.isneginf(masked.float()).all(-1)
    status = torch.where(broken, BROKEN, torch.where(nothing, MASKED_OUT, OK))
    greedy = torch.where(status == OK, masked.float().argmax(-1), -1)
    return greedy.tolist(), status.tolist(), masked
