"""Turns next-token logits into token ids: greedy, or temperature with top-k / top-p, optionally seeded.

Sampling is total: any accepted SamplingParams gives a token for finite logits (a tiny temperature acts as
greedy, a top-p that keeps nothing keeps the top token); a row of logits that are not numbers gives no token,
and the engine fails that request alone. A sequence with a grammar matcher draws only among the tokens its
grammar allows next (its mask is usually computed while the model ran: grammar_masks.py), after its penalties,
logit_bias, min_tokens, allowed_token_ids and bad words (logits_processors.py); logprobs stay the model's own,
before any of these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from cpu_kernels.logits_scan import BROKEN, OK, logits_scan
from hybrid.engine.grammar_masks import MaskPrefetcher, MaskProcessSpec
from hybrid.engine.logits_processors import adjust_logits_, adjusts
from hybrid.engine.outputs import TokenLogprob
from hybrid.engine.sequence import Sequence
from hybrid.structured_output.backend import GrammarBackend

NOT_NUMBERS = "the model produced logits that are not numbers (NaN or infinite) for this request"
LOGPROB_FLOOR = -9999.0
NOTHING_ALLOWED = "the request's grammar, min_tokens, allowed_token_ids or bad_words allow no next token"
GRAMMAR_FAILED = "the request's grammar cannot be followed further: {}"


@dataclass
class Sample:
    """One row's draw: `token` is None when no token could be drawn, `error` says why and `error_status` whose
    fault it is (400: the request's own restrictions leave nothing); `logprob` is filled when the request asked
    for logprobs."""

    token: int | None
    logprob: TokenLogprob | None = None
    error: str | None = None
    error_status: int = 500


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Masks (to -inf) tokens outside the top-k, outside the smallest set whose probability reaches top_p, and
    less likely than min_p times the most likely token; the most likely token always survives."""
    if min_p > 0.0:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
        logits = logits.masked_fill(logits < logits.max() + math.log(min_p), float("-inf"))
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


def token_logprobs(rows: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """For each row of logits, the model's log-probability of the token it predicts (a prompt token, or the one
    drawn), its rank, and the k most likely tokens, before temperature and filters; never below LOGPROB_FLOOR."""
    if not token_ids:
        return []
    # -inf (a logit the model itself sent to -inf) and NaN have no JSON spelling: vLLM's floor stands for both.
    logp = torch.log_softmax(rows.float(), dim=-1).nan_to_num(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)
    chosen = logp.gather(1, torch.tensor(token_ids).unsqueeze(1))
    ranks = (logp >= chosen).sum(dim=1).tolist()  # vLLM's count: tokens tied with this one rank it lower
    if k:
        top = torch.topk(logp, k)
        tops = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(t, lp, tp, r) for t, lp, tp, r in zip(token_ids, chosen.squeeze(1).tolist(), tops, ranks)]


def no_token(seq: Sequence, broken: bool) -> Sample:
    """The sample of a row nothing can be drawn from: the model's fault when its logits are broken, else the
    request's (its grammar's own failure named where the backend met one: an empty mask is how it shows)."""
    if broken:
        return Sample(None, error=NOT_NUMBERS)
    if seq.matcher is not None and (failure := seq.matcher.failure) is not None:
        return Sample(None, error=GRAMMAR_FAILED.format(failure), error_status=400)
    return Sample(None, error=NOTHING_ALLOWED, error_status=400)


class Sampler:
    """`grammars` is set by the engine once a request has brought a grammar; with `mask_process` the masks are
    computed in a mask process of that model while the model runs."""

    def __init__(self, mask_process: MaskProcessSpec | None = None, eos_ids: set[int] | None = None) -> None:
        self.grammars: GrammarBackend | None = None
        self.masks = MaskPrefetcher(mask_process)
        self.eos_ids = eos_ids or set()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sample]:
        """logits [len(seqs), vocab] in fp32 or the model's dtype, on any device: widened to fp32 only for a batch
        with a row that draws at random or with its logits adjusted (greedy rows, grammar masks and logprobs read
        them as they are, exactly)."""
        if logits.device.type != "cpu":
            # A device's logits come over once ([batch, vocab]: ~2 MB for 8 rows of 129K in bf16): the scan
            # kernel, grammar masks, seeded generators and the adjustments all work on the CPU.
            logits = logits.cpu()
        adjusted = [row for row, seq in enumerate(seqs) if adjusts(seq)]
        constrained = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
        widen = (logits.dtype not in (torch.float32, torch.bfloat16)  # fp16 (torch backend or a device): no scan
                 or bool(adjusted) or any(not seq.params.greedy for seq in seqs))
        raw = logits.float() if widen else logits
        logits = raw.clone() if adjusted else raw  # raw stays the model's own: logprobs are read from it
        broken = None
        if adjusted:
            broken = [status == BROKEN for status in logits_scan(raw)[1]]  # the model's fault, before adjustments
            adjust_logits_(logits, seqs, adjusted, self.eos_ids)
        bits = self.grammar_masks(seqs, constrained)
        if bits is not None and not adjusted and any(seq.params.logprobs is not None for seq in seqs):
            logits = logits.clone()  # the scan masks in place
        # One read of each row: the greedy token among what the adjustments and the grammar leave, the row's health.
        rows = None if bits is None or len(constrained) == len(seqs) else constrained
        greedy, status = logits_scan(logits, bits, rows)
        if broken is None:
            broken = [s == BROKEN for s in status]
        unsatisfiable = {row for row in constrained + adjusted if status[row] != OK}
        out = []
        for row, seq in enumerate(seqs):
            p = seq.params
            if broken[row] or row in unsatisfiable:
                out.append(no_token(seq, broken[row]))
                continue
            if p.greedy:
                token = greedy[row]
            else:
                filtered = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p, p.min_p)
                probs = torch.softmax(filtered, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=seq.generator).item())
            lp = token_logprobs(raw[row:row + 1], [token], p.logprobs)[0] if p.logprobs is not None else None
            out.append(Sample(token, lp))
        return out

    def grammar_masks(self, seqs: list[Sequence], rows: list[int]) -> np.ndarray | None:
        """The bitmask of each constrained row (rows: their indices in seqs), None when there are none."""
        if not rows:
            return None
        return self.masks.take(self.grammars, seqs if len(rows) == len(seqs) else [seqs[row] for row in rows])

    def accept(self, seqs: list[Sequence], samples: list[Sample]) -> None:
        """Advances the constrained rows' matchers by their drawn tokens; a token a grammar refuses (which a mask
        should have ruled out) becomes that row's error."""
        for seq, sample in zip(seqs, samples):
            if seq.matcher is not None and sample.token is not None and not seq.matcher.accept(sample.token):
                if (failure := seq.matcher.failure) is not None:  # the grammar's fault, not the mask's
                    sample.token, sample.error, sample.error_status = None, GRAMMAR_FAILED.format(failure), 400
                else:
                    sample.token, sample.error = None, f"token {sample.token} does not follow the request's grammar"

    def prefetch(self, seqs: list[Sequence]) -> None:
        """Starts computing the next masks of the constrained sequences among seqs, whose matchers have taken
        this step's tokens."""
        if self.grammars is not None:
            self.masks.submit(seqs)

    def close(self) -> None:
        self.masks.close()
