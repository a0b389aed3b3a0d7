"""Per-request changes to next-token logits before a token is drawn: the repetition penalty (HF's and vLLM's: a
token seen in the prompt or the completion has a positive logit divided by it and a negative one multiplied),
OpenAI's frequency and presence penalties (over the completion's tokens: minus frequency x count, minus presence
once), logit_bias (added), min_tokens (the end-of-sequence and stop token ids are barred until that many
tokens are generated), and vLLM's allowed_token_ids (every other token barred) and bad words (a bad word's last
token barred where the completion ends with the tokens before it), applied in that order.

Each is computed from the sequence's tokens at every step, so nothing has to follow preemption, a hand-off to a
decode engine or the prefix cache. The sampler keeps reporting the model's own logprobs, before these.
"""

from __future__ import annotations

import torch

from hybrid.engine.sequence import Sequence


def adjusts(seq: Sequence) -> bool:
    """Whether this step changes the sequence's logits (min_tokens only until it is reached)."""
    p = seq.params
    return (bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
                 or p.bad_words_ids) or p.allowed_token_ids is not None or seq.num_completion_tokens < p.min_tokens)


def barred_until_min_tokens(seq: Sequence, eos_ids: set[int]) -> list[int]:
    p = seq.params
    return sorted((set() if p.ignore_eos else eos_ids) | set(p.stop_token_ids))


def barred_bad_word_ends(seq: Sequence) -> list[int]:
    """The last tokens of the bad words whose other tokens the completion ends with."""
    completion = seq.completion_ids
    return sorted({w[-1] for w in seq.params.bad_words_ids
                   if len(w) - 1 <= len(completion) and completion[len(completion) - len(w) + 1:] == w[:-1]})


def adjust_row_(logits: torch.Tensor, seq: Sequence, eos_ids: set[int]) -> None:
    """Applies the sequence's adjustments to its row of fp32 logits [vocab], in place."""
    p = seq.params
    vocab = logits.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.unique(torch.tensor(seq.token_ids, dtype=torch.long))
        seen = seen[seen < vocab]
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and seq.num_completion_tokens:
        ids, counts = torch.unique(torch.tensor(seq.completion_ids, dtype=torch.long), return_counts=True)
        keep = ids < vocab
        ids, counts = ids[keep], counts[keep]
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        keep = ids < vocab
        logits.index_add_(0, ids[keep], torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)[keep])
    if seq.num_completion_tokens < p.min_tokens:
        barred = [t for t in barred_until_min_tokens(seq, eos_ids) if t < vocab]
        logits[barred] = float("-inf")
    if p.allowed_token_ids is not None:
        barred_mask = torch.ones(vocab, dtype=torch.bool)
        allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long)
        barred_mask[allowed[allowed < vocab]] = False
        logits.masked_fill_(barred_mask, float("-inf"))
    if p.bad_words_ids:
        logits[[t for t in barred_bad_word_ends(seq) if t < vocab]] = float("-inf")


def adjust_logits_(logits: torch.Tensor, seqs: list[Sequence], rows: list[int], eos_ids: set[int]) -> None:
    """Applies each listed row's adjustments to `logits` [len(seqs), vocab] (fp32), in place."""
    for row in rows:
        adjust_row_(logits[row], seqs[row], eos_ids)


def adjust_row_reference(logits: torch.Tensor, seq: Sequence, eos_ids: set[int]) -> torch.Tensor:
    """The same, token by token in plain Python: what the tests hold adjust_row_ to."""
    p = seq.params
    out = logits.clone()
    for t in set(seq.token_ids):
        if p.repetition_penalty != 1.0 and t < len(out):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    completion = seq.completion_ids
    for t in set(completion):
        out[t] -= p.frequency_penalty * completion.count(t) + p.presence_penalty
    for t, bias in p.logit_bias.items():
        out[t] += bias
    if len(completion) < p.min_tokens:
        for t in (set() if p.ignore_eos else eos_ids) | set(p.stop_token_ids):
            out[t] = float("-inf")
    if p.allowed_token_ids is not None:
        for t in range(len(out)):
            if t not in p.allowed_token_ids:
                out[t] = float("-inf")
    for word in p.bad_words_ids:
        before = word[:-1]
        if len(completion) >= len(before) and all(a == b for a, b in zip(reversed(completion), reversed(before))):
            out[word[-1]] = float("-inf")
    return out
