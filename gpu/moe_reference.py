"""Fused MoE in pure torch over dequantized weights: the reference for gpu/fused_moe.py, with its rounding points
(products summed in float32, the SiLU-gated intermediate rounded to the activation dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, present: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I] in float32; `present` [E] bool limits
    the sum to those experts (negative ids never count)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        if present is not None and not bool(present[e]):
            continue
        tok, j = torch.nonzero(topk_ids == e, as_tuple=True)
        h = xf[tok] @ w13[e].T
        act = (F.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype).float()
        out.index_add_(0, tok, (act @ w2[e].T) * topk_weights[tok, j, None].float())
    return out.to(x.dtype)
