"""Turns next-token logits into token ids: greedy, or temperature with top-k / top-p, optionally seeded."""

from __future__ import annotations

import torch

from hybrid.engine.sequence import Sequence


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks (to -inf) tokens outside the top-k and outside the smallest set whose probability reaches top_p."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = torch.zeros_like(logits, dtype=torch.bool)
        drop[order] = mass_before >= top_p
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        logits = logits.float()
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                out.append(greedy[row])
                continue
            filtered = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(filtered, dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=seq.generator).item()))
        return out
