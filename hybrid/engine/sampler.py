"""Turns next-token logits into token ids: greedy, or temperature with top-k / top-p, optionally seeded.

Sampling is total: any accepted SamplingParams gives a token for finite logits (a tiny temperature acts as
greedy, a top-p that keeps nothing keeps the top token); a row of logits that are not numbers gives no token,
and the engine fails that request alone. A sequence with a grammar matcher draws only among the tokens its
grammar allows next; logprobs stay the model's own, before the mask. A greedy row needs no mask when one of
its GREEDY_CANDIDATES most likely tokens is allowed: the first allowed of them, best first, is the masked
argmax; only when none is does the row get a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.engine.outputs import TokenLogprob
from hybrid.engine.sequence import Sequence
from hybrid.structured_output.backend import FORBIDDEN, GrammarBackend

NOT_NUMBERS = "the model produced logits that are not numbers (NaN or infinite) for this request"
NOTHING_ALLOWED = "the request's grammar allows no next token"

# A constrained request checks whether it must start closing its grammar (structured_output/backend.py) over
# its last CLOSING_HORIZON tokens, and starts CLOSING_MARGIN tokens early: the model's pick among the closing
# tokens may take a few more than the distance counted.
CLOSING_HORIZON = 96
CLOSING_MARGIN = 4
GREEDY_CANDIDATES = 8


@dataclass
class Sample:
    """One row's draw: `token` is None when no token could be drawn, and `error` says why; `logprob` is filled
    when the request asked for logprobs."""

    token: int | None
    logprob: TokenLogprob | None = None
    error: str | None = None


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
    """`grammars` is set by the engine once a request has brought a grammar."""

    def __init__(self) -> None:
        self.grammars: GrammarBackend | None = None

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sample]:
        raw = logits.float()
        broken = broken_rows(raw).tolist()
        closing = {row for row, seq in enumerate(seqs) if seq.matcher is not None and self.must_close(seq)}
        picked = self.pick_greedy(raw, seqs, closing)
        logits, unsatisfiable = self.apply_grammars(raw, seqs, picked, closing)
        greedy = [picked.get(row, t) for row, t in enumerate(logits.argmax(dim=-1).tolist())]
        out = []
        for row, seq in enumerate(seqs):
            p = seq.params
            if broken[row] or row in unsatisfiable:
                out.append(Sample(None, error=NOT_NUMBERS if broken[row] else NOTHING_ALLOWED))
                continue
            if p.greedy:
                token = greedy[row]
            else:
                filtered = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p)
                probs = torch.softmax(filtered, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=seq.generator).item())
            lp = token_logprobs(raw[row:row + 1], [token], p.logprobs)[0] if p.logprobs is not None else None
            out.append(Sample(token, lp))
        return out

    def pick_greedy(self, logits: torch.Tensor, seqs: list[Sequence], closing: set[int]) -> dict[int, int]:
        """Greedy constrained rows (not closing) whose grammar allows one of their best candidates: row -> that
        token. A candidate tied with the last one is not taken, as a token outside the candidates may tie it."""
        rows = [row for row, seq in enumerate(seqs)
                if seq.matcher is not None and seq.params.greedy and row not in closing]
        if not rows:
            return {}
        top = torch.topk(logits if len(rows) == len(seqs) else logits[rows], min(GREEDY_CANDIDATES, logits.shape[-1]))
        picked = {}
        for row, values, ids in zip(rows, top.values.tolist(), top.indices.tolist()):
            candidates = zip(values, ids)
            if len(set(values)) < len(values):  # ties: the lowest id first, as argmax takes it
                candidates = sorted(candidates, key=lambda c: (-c[0], c[1]))
            for value, token in candidates:
                if value <= values[-1]:
                    break
                if seqs[row].matcher.allows(token):
                    picked[row] = token
                    break
        return picked

    def apply_grammars(self, logits: torch.Tensor, seqs: list[Sequence], picked: dict[int, int],
                       closing: set[int]) -> tuple[torch.Tensor, set[int]]:
        """Logits with the tokens each constrained row's grammar forbids pushed to FORBIDDEN (rows in `picked`
        are left alone; rows in `closing` keep only their closing tokens), and the rows whose grammar allows
        nothing."""
        rows = [row for row, seq in enumerate(seqs) if seq.matcher is not None and row not in picked]
        if not rows:
            return logits, set()
        bias, nothing = self.grammars.bias([seqs[row].matcher for row in rows])
        closes = [i for i, row in enumerate(rows) if row in closing]
        if closes:
            keep = self.grammars.closing(bias[closes] == 0)
            bias[closes] = torch.zeros_like(bias[closes]).masked_fill(~keep, FORBIDDEN)
        if len(rows) == len(seqs):
            logits = logits + bias
        else:
            logits = logits.clone()
            logits[rows] += bias
        return logits, {rows[i] for i in nothing}

    def must_close(self, seq: Sequence) -> bool:
        """True once the tokens seq has left are only just enough to finish its grammar; it stays so."""
        left = seq.params.max_tokens - seq.num_completion_tokens
        if not seq.closing and left <= CLOSING_HORIZON:
            seq.closing = left <= self.grammars.closing_distance(seq.matcher, left) + CLOSING_MARGIN
        return seq.closing
