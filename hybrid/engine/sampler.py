"""Turns next-token logits into token ids: greedy, or temperature with top-k / top-p, optionally seeded.

Sampling is total: any accepted SamplingParams gives a token for finite logits (a tiny temperature acts as
greedy, a top-p that keeps nothing keeps the top token); a row of logits that are not numbers gives no token,
and the engine fails that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.engine.outputs import TokenLogprob
from hybrid.engine.sequence import Sequence


@dataclass
class Sample:
    """One row's draw: `token` is None when the row's logits were not numbers; `logprob` is filled when the
    request asked for logprobs."""

    token: int | None
    logprob: TokenLogprob | None = None


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks (to -inf) tokens outside the top-k and outside the smallest set whose probability reaches top_p;
    the most likely token always survives."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        sorted_drop = mass_before >= top_p
        sorted_drop[0] = False
        drop = torch.zeros_like(logits, dtype=torch.bool)
        drop[order] = sorted_drop
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def broken_rows(logits: torch.Tensor) -> torch.Tensor:
    """Rows no token can be drawn from: any NaN or +inf, or nothing above -inf."""
    return torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | torch.isneginf(logits).all(-1)


def token_logprobs(rows: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """For each row of logits, the model's log-probability of the token it predicts (a prompt token, or the one
    drawn) and its k most likely tokens, before temperature and filters."""
    if not token_ids:
        return []
    logp = torch.log_softmax(rows.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids).unsqueeze(1)).squeeze(1).tolist()
    if k:
        top = torch.topk(logp, k)
        tops = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(token_ids, chosen, tops)]


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sample]:
        logits = logits.float()
        broken = broken_rows(logits).tolist()
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for row, seq in enumerate(seqs):
            p = seq.params
            if broken[row]:
                out.append(Sample(None))
                continue
            if p.greedy:
                token = greedy[row]
            else:
                filtered = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p)
                probs = torch.softmax(filtered, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=seq.generator).item())
            lp = token_logprobs(logits[row:row + 1], [token], p.logprobs)[0] if p.logprobs is not None else None
            out.append(Sample(token, lp))
        return out
